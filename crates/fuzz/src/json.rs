//! Structure-aware mutation of JSON states: a valid saved state with a few of its values
//! changed, removed or replaced, so restores see inputs that pass the parser and reach the
//! checks behind it (pure garbage rarely gets past serde).

use kumo_devices::Persist;
use serde_json::{Map, Number, Value};

use crate::Input;

/// Numbers that sit on the edges of the types states use.
const EDGES: &[i128] = &[
    0,
    1,
    -1,
    2,
    7,
    8,
    15,
    16,
    31,
    32,
    63,
    64,
    65,
    255,
    256,
    4095,
    4096,
    65535,
    65536,
    i32::MAX as i128,
    u32::MAX as i128,
    u32::MAX as i128 + 1,
    i64::MAX as i128,
    u64::MAX as i128,
];

fn number(u: &mut Input<'_>, old: Option<&Number>) -> arbitrary::Result<Value> {
    let v: i128 = match u.int_in_range(0..=4)? {
        0 => EDGES[u.choose_index(EDGES.len())?],
        1 => u.arbitrary::<u8>()? as i128,
        2 => u.arbitrary::<u64>()? as i128,
        3 => {
            let bit = 1i128 << u.int_in_range(0..=63)?;
            old.and_then(Number::as_u64).map_or(0, |o| o as i128 ^ bit)
        }
        _ => return Ok(Value::from(u.arbitrary::<f64>()?)),
    };
    Ok(if v < 0 { Value::from(v as i64) } else { Value::from(v as u64) })
}

/// A small arbitrary value of any JSON type.
pub fn arbitrary_value(u: &mut Input<'_>, depth: u32) -> arbitrary::Result<Value> {
    Ok(match u.int_in_range(0..=6)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 | 3 => number(u, None)?,
        4 => Value::String(u.arbitrary()?),
        5 if depth < 3 => {
            let n = u.int_in_range(0..=4)?;
            Value::Array((0..n).map(|_| arbitrary_value(u, depth + 1)).collect::<arbitrary::Result<_>>()?)
        }
        _ => Value::Object(Map::new()),
    })
}

/// Every path (keys and indices) in `v`.
fn paths(v: &Value, at: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
    out.push(at.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(PathStep::Index(i));
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                at.push(PathStep::Key(k.clone()));
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

#[derive(Debug, Clone)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn at_path<'v>(v: &'v mut Value, path: &[PathStep]) -> Option<&'v mut Value> {
    path.iter().try_fold(v, |v, s| match s {
        PathStep::Key(k) => v.get_mut(k.as_str()),
        PathStep::Index(i) => v.get_mut(*i),
    })
}

/// A node found by walking down from the root, stopping at each level now and then: the
/// top-level fields of a state get their share.
fn descend<'v>(u: &mut Input<'_>, mut v: &'v mut Value) -> arbitrary::Result<&'v mut Value> {
    loop {
        let n = match &*v {
            Value::Array(a) => a.len(),
            Value::Object(m) => m.len(),
            _ => 0,
        };
        if n == 0 || u.ratio(1, 3)? {
            return Ok(v);
        }
        let i = u.choose_index(n)?;
        v = match v {
            Value::Array(a) => &mut a[i],
            Value::Object(m) => m.values_mut().nth(i).expect("in range"),
            _ => unreachable!("containers only"),
        };
    }
}

/// Applies one to four mutations to `v`, each at a node chosen among all its nodes.
pub fn mutate(u: &mut Input<'_>, v: &mut Value) -> arbitrary::Result<()> {
    for _ in 0..u.int_in_range(1..=4)? {
        let node = if u.arbitrary()? {
            // Any node, uniformly: big arrays (an XSAVE area, register pages) get most hits.
            let mut all = Vec::new();
            paths(v, &mut Vec::new(), &mut all);
            let path = &all[u.choose_index(all.len())?];
            let Some(node) = at_path(v, path) else { continue };
            node
        } else {
            descend(u, v)?
        };
        match (u.int_in_range(0..=5)?, &mut *node) {
            (0 | 1, Value::Number(n)) => *node = number(u, Some(&n.clone()))?,
            (0 | 1, Value::Bool(b)) => *b = !*b,
            (0 | 1, Value::String(s)) => {
                if u.arbitrary()? {
                    s.push_str(&u.arbitrary::<String>()?)
                } else {
                    let n = u.int_in_range(0..=s.len())?;
                    s.truncate((0..=n).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0));
                }
            }
            (2, Value::Array(a)) => {
                // Grow (duplicating an element, so the shape stays plausible) or shrink.
                if !a.is_empty() && u.arbitrary()? {
                    let i = u.choose_index(a.len())?;
                    a.truncate(i);
                } else {
                    let x = match a.first() {
                        Some(x) => x.clone(),
                        None => arbitrary_value(u, 1)?,
                    };
                    for _ in 0..u.int_in_range(1..=70)? {
                        a.push(x.clone());
                    }
                }
            }
            (3, Value::Object(m)) if !m.is_empty() => {
                let k = m.keys().nth(u.choose_index(m.len())?).cloned().unwrap_or_default();
                m.remove(&k);
            }
            (3, Value::Object(m)) => {
                m.insert(u.arbitrary()?, arbitrary_value(u, 1)?);
            }
            _ => *node = arbitrary_value(u, 1)?,
        }
    }
    Ok(())
}

/// `v` mutated most of the time, or the raw input as JSON text now and then.
pub fn mutated_or_garbage(u: &mut Input<'_>, valid: &Value) -> arbitrary::Result<Value> {
    if u.ratio(1, 16)? {
        let text: &str = u.arbitrary()?;
        return Ok(serde_json::from_str(text).unwrap_or(Value::Null));
    }
    let mut v = valid.clone();
    mutate(u, &mut v)?;
    Ok(v)
}

/// `c`'s state as JSON, the form a snapshot file or a migration peer sends it in.
pub fn save_json<P: Persist + ?Sized>(c: &P) -> Value {
    serde_json::to_value(c.save().expect("saves")).expect("a state encodes")
}

/// Decodes `v` as `c`'s state and restores it. A state that does not decode is refused as
/// the snapshot's decoder refuses it, before the component sees it.
pub fn restore_json<P: Persist + ?Sized>(c: &mut P, v: Value) -> Result<(), String> {
    let s: P::State = serde_json::from_value(v).map_err(|e| format!("{}: saved state does not fit: {e}", c.id()))?;
    c.restore(&s).map_err(|e| e.to_string())
}
