//! A checker for the subset of OpenAPI 3.0 schemas docs/openapi.yaml uses: `$ref`, `type`,
//! `nullable`, `required`, `properties`, `additionalProperties`, `items`, `enum`, `oneOf`,
//! `minimum`/`maximum`. Objects are closed unless their schema says `additionalProperties`: a
//! field the server sends that the document does not describe is an error, so the document
//! stays exactly what the server does.

use serde_json::Value;

pub struct Spec {
    pub doc: Value,
}

impl Spec {
    pub fn load() -> Spec {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.yaml");
        let text = std::fs::read_to_string(path).expect("read docs/openapi.yaml");
        let doc: Value = serde_yaml::from_str(&text).expect("docs/openapi.yaml is YAML");
        Spec { doc }
    }

    /// Every (METHOD, full path) the document describes.
    pub fn routes(&self) -> Vec<(String, String)> {
        let base = self.doc["servers"][0]["url"].as_str().expect("servers[0].url");
        let base = base.trim_start_matches("http://localhost");
        let mut out = Vec::new();
        for (path, ops) in self.doc["paths"].as_object().expect("paths") {
            for method in ops.as_object().expect("path item").keys() {
                out.push((method.to_uppercase(), format!("{base}{path}")));
            }
        }
        out.sort();
        out
    }

    /// The operation object of a route.
    pub fn operation(&self, method: &str, full_path: &str) -> &Value {
        let path = full_path.trim_start_matches("/api/v1");
        let op = &self.doc["paths"][path][method.to_lowercase()];
        assert!(op.is_object(), "docs/openapi.yaml has no {method} {full_path}");
        op
    }

    /// The schema of `status`'s body for an operation (the exact code, else `default`), or
    /// None for a response without content. Panics if the status is not documented at all.
    pub fn response_schema(&self, method: &str, full_path: &str, status: u16, media: &str) -> Option<&Value> {
        let op = self.operation(method, full_path);
        let responses = &op["responses"];
        let r = match responses.get(status.to_string()) {
            Some(r) => r,
            None => responses
                .get("default")
                .unwrap_or_else(|| panic!("{method} {full_path}: status {status} is not documented")),
        };
        let r = self.resolve(r);
        let content = r.get("content")?;
        let m = content
            .get(media)
            .unwrap_or_else(|| panic!("{method} {full_path} {status}: no {media} content documented"));
        Some(&m["schema"])
    }

    fn resolve<'a>(&'a self, v: &'a Value) -> &'a Value {
        match v.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let mut cur = &self.doc;
                for part in r.trim_start_matches("#/").split('/') {
                    cur = &cur[part];
                }
                assert!(!cur.is_null(), "dangling $ref {r}");
                self.resolve(cur)
            }
            None => v,
        }
    }

    /// Checks `value` against `schema`; the error names the JSON path that does not fit.
    pub fn check(&self, schema: &Value, value: &Value) -> Result<(), String> {
        self.check_at(schema, value, "$")
    }

    fn check_at(&self, schema: &Value, v: &Value, at: &str) -> Result<(), String> {
        let s = self.resolve(schema);
        if v.is_null() {
            return if s["nullable"] == Value::Bool(true) || s.as_object().is_some_and(|o| o.is_empty()) {
                Ok(())
            } else {
                Err(format!("{at}: null where the schema does not allow it"))
            };
        }
        if let Some(alts) = s.get("oneOf").or_else(|| s.get("anyOf")).and_then(Value::as_array) {
            let errs: Vec<String> = alts.iter().filter_map(|a| self.check_at(a, v, at).err()).collect();
            return if errs.len() < alts.len() {
                Ok(())
            } else {
                Err(format!("{at}: fits none of the alternatives: {}", errs.join("; ")))
            };
        }
        if let Some(vals) = s.get("enum").and_then(Value::as_array) {
            if !vals.contains(v) {
                return Err(format!("{at}: {v} is not one of {}", Value::Array(vals.clone())));
            }
        }
        let ty = s.get("type").and_then(Value::as_str);
        let ok = match ty {
            None => true,
            Some("object") => v.is_object(),
            Some("array") => v.is_array(),
            Some("string") => v.is_string(),
            Some("boolean") => v.is_boolean(),
            Some("integer") => v.is_i64() || v.is_u64(),
            Some("number") => v.is_number(),
            Some(t) => return Err(format!("{at}: unknown schema type {t}")),
        };
        if !ok {
            return Err(format!("{at}: {v} is not of type {}", ty.unwrap_or("?")));
        }
        if let Some(n) = v.as_f64() {
            if s.get("minimum").and_then(Value::as_f64).is_some_and(|m| n < m) {
                return Err(format!("{at}: {n} is below the minimum"));
            }
            if s.get("maximum").and_then(Value::as_f64).is_some_and(|m| n > m) {
                return Err(format!("{at}: {n} is above the maximum"));
            }
        }
        if let Some(items) = v.as_array() {
            if let Some(item_schema) = s.get("items") {
                for (i, item) in items.iter().enumerate() {
                    self.check_at(item_schema, item, &format!("{at}[{i}]"))?;
                }
            }
        }
        if let Some(obj) = v.as_object() {
            let props = s.get("properties").and_then(Value::as_object);
            for req in s.get("required").and_then(Value::as_array).into_iter().flatten() {
                let k = req.as_str().unwrap_or_default();
                if !obj.contains_key(k) {
                    return Err(format!("{at}: required field {k} is missing"));
                }
            }
            for (k, val) in obj {
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => self.check_at(ps, val, &format!("{at}.{k}"))?,
                    None => match s.get("additionalProperties") {
                        Some(Value::Bool(true)) => {}
                        Some(extra @ Value::Object(_)) => self.check_at(extra, val, &format!("{at}.{k}"))?,
                        // A free-form object (`type: object` and nothing else) is allowed only
                        // where the document says so with additionalProperties.
                        _ => return Err(format!("{at}: field {k} is not in the schema")),
                    },
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod checker_tests {
    use super::*;
    use serde_json::json;

    fn spec(schemas: Value) -> Spec {
        Spec { doc: json!({ "components": { "schemas": schemas } }) }
    }

    #[test]
    fn the_checker_catches_what_it_must() {
        let s = spec(json!({
            "A": { "type": "object", "required": ["n"], "properties": {
                "n": { "type": "integer", "minimum": 0 },
                "s": { "type": "string", "enum": ["x", "y"] },
                "l": { "type": "array", "items": { "$ref": "#/components/schemas/B" } },
                "o": { "type": "object", "nullable": true, "additionalProperties": { "type": "number" } } } },
            "B": { "type": "boolean" }
        }));
        let a = json!({ "$ref": "#/components/schemas/A" });
        assert!(s.check(&a, &json!({ "n": 1, "s": "x", "l": [true], "o": { "k": 1.5 } })).is_ok());
        assert!(s.check(&a, &json!({ "n": 1, "o": null })).is_ok());
        assert!(s.check(&a, &json!({ "s": "x" })).unwrap_err().contains("required field n"));
        assert!(s.check(&a, &json!({ "n": -1 })).unwrap_err().contains("minimum"));
        assert!(s.check(&a, &json!({ "n": 1, "s": "z" })).unwrap_err().contains("not one of"));
        assert!(s.check(&a, &json!({ "n": 1, "l": [1] })).unwrap_err().contains("$.l[0]"));
        assert!(s.check(&a, &json!({ "n": 1, "extra": 1 })).unwrap_err().contains("field extra"));
        assert!(s.check(&a, &json!({ "n": 1, "o": { "k": "no" } })).unwrap_err().contains("$.o.k"));
        assert!(s.check(&a, &json!({ "n": 1.5 })).unwrap_err().contains("integer"));
    }
}
