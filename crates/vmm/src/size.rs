//! A byte size in a config file: a number, or a string with a unit (`"256M"`), as the flags
//! take it. Shared by the config and its parts (`guest_numa`, `elastic`), which it depends on
//! none of.

use serde::{Deserialize, Deserializer};

pub(crate) fn size_de<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        N(u64),
        S(String),
    }
    match Size::deserialize(d)? {
        Size::N(n) => Ok(n),
        Size::S(s) => kumo_vm::parse_size(&s).map_err(serde::de::Error::custom),
    }
}
