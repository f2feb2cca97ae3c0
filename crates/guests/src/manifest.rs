//! A guest's manifest: `key=value` lines embedded in its ELF (see guests/include/kumo.h).

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ParamKind {
    /// Decimal, or hexadecimal with `0x`.
    U64,
    /// An IPv4 address `a.b.c.d`.
    Ipv4,
    Choice(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Param {
    pub key: String,
    pub kind: ParamKind,
    pub default: String,
    pub help: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    pub name: String,
    pub summary: String,
    pub min_cpus: u32,
    pub max_cpus: u32,
    pub params: Vec<Param>,
}

impl Param {
    pub fn check(&self, value: &str) -> Result<(), String> {
        match &self.kind {
            ParamKind::U64 => {
                let n = match value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
                    Some(hex) => u64::from_str_radix(hex, 16).ok(),
                    None => value.parse::<u64>().ok(),
                };
                n.map(|_| ()).ok_or_else(|| format!("`{}` wants a number, got `{value}`", self.key))
            }
            ParamKind::Ipv4 => value
                .parse::<std::net::Ipv4Addr>()
                .map(|_| ())
                .map_err(|_| format!("`{}` wants an IPv4 address a.b.c.d, got `{value}`", self.key)),
            ParamKind::Choice(c) if c.iter().any(|x| x == value) => Ok(()),
            ParamKind::Choice(c) => Err(format!("`{}` is one of {}, got `{value}`", self.key, c.join(", "))),
        }
    }

    /// The type as shown to users: `u64` or `a|b`.
    pub fn kind_str(&self) -> String {
        match &self.kind {
            ParamKind::U64 => "u64".into(),
            ParamKind::Ipv4 => "ipv4".into(),
            ParamKind::Choice(c) => c.join("|"),
        }
    }
}

impl Manifest {
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
        let text = text.trim_end_matches('\0');
        let mut m = Manifest { name: String::new(), summary: String::new(), min_cpus: 1, max_cpus: 1, params: vec![] };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("line `{line}` is not key=value"))?;
            match k {
                "name" => m.name = v.to_string(),
                "summary" => m.summary = v.to_string(),
                "min_cpus" => m.min_cpus = v.parse().map_err(|_| format!("bad min_cpus `{v}`"))?,
                "max_cpus" => m.max_cpus = v.parse().map_err(|_| format!("bad max_cpus `{v}`"))?,
                "param" => {
                    let mut f = v.splitn(4, ':');
                    let (key, kind, default, help) = match (f.next(), f.next(), f.next(), f.next()) {
                        (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
                        _ => return Err(format!("param `{v}` is not KEY:TYPE:DEFAULT:HELP")),
                    };
                    let kind = if kind == "u64" {
                        ParamKind::U64
                    } else if kind == "ipv4" {
                        ParamKind::Ipv4
                    } else {
                        ParamKind::Choice(kind.split('|').map(String::from).collect())
                    };
                    let p = Param { key: key.into(), kind, default: default.into(), help: help.into() };
                    p.check(default).map_err(|e| format!("default of {e}"))?;
                    m.params.push(p);
                }
                other => return Err(format!("unknown manifest key `{other}`")),
            }
        }
        if m.name.is_empty() {
            return Err("no name".into());
        }
        if m.min_cpus == 0 || m.min_cpus > m.max_cpus {
            m.max_cpus = m.max_cpus.max(m.min_cpus);
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_params_and_defaults() {
        let m = Manifest::parse(b"name=x\nsummary=s\nmax_cpus=4\nparam=n:u64:3:count\nparam=m:a|b:a:how\0").unwrap();
        assert_eq!((m.min_cpus, m.max_cpus), (1, 4));
        assert_eq!(m.params[1].kind, ParamKind::Choice(vec!["a".into(), "b".into()]));
        assert_eq!(m.params[0].help, "count");
    }

    #[test]
    fn ipv4_and_hex_values() {
        let m = Manifest::parse(b"name=x\nparam=ip:ipv4:10.0.0.2:addr\nparam=v:u64:0xe0:vector\0").unwrap();
        assert_eq!(m.params[0].kind, ParamKind::Ipv4);
        assert_eq!(m.params[0].kind_str(), "ipv4");
        assert!(m.params[0].check("192.168.1.20").is_ok());
        assert!(m.params[0].check("10.0.0.256").unwrap_err().contains("IPv4"));
        assert!(m.params[0].check("10.0.0").is_err());
        assert!(m.params[1].check("0xff").is_ok());
        assert!(m.params[1].check("224").is_ok());
        assert!(m.params[1].check("0xzz").is_err());
        assert!(Manifest::parse(b"name=x\nparam=ip:ipv4:nope:addr").is_err());
    }

    #[test]
    fn rejects_malformed_manifests() {
        assert!(Manifest::parse(b"summary=s").unwrap_err().contains("no name"));
        assert!(Manifest::parse(b"name=x\nparam=n:u64").is_err());
        assert!(Manifest::parse(b"name=x\nparam=n:u64:zz:h").unwrap_err().contains("number"));
        assert!(Manifest::parse(b"name=x\nwhat=1").unwrap_err().contains("unknown manifest key"));
        assert!(Manifest::parse(&[0xff, 0xfe]).is_err());
    }
}
