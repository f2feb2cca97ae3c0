//! [`MigrationEngine`]: how a migration moves pages. The one definition: the control API
//! (`kumo_api` re-exports it), the CLI (`--engine`, through clap's `ValueEnum` with the `clap`
//! feature) and the engines in `kumo-migration-engine` all use it.

use serde::{Deserialize, Serialize};

/// How pages travel (docs/migration.md, "Engines").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum MigrationEngine {
    /// Copy, send and wait for each batch to be placed: one batch in flight.
    Serial,
    /// Copy batch k+1 while batch k is on the wire.
    Overlap,
    /// Send straight from guest memory (MSG_ZEROCOPY).
    Zerocopy,
    /// Same host, unix:PATH only: guest memory is shared, not copied.
    Local,
}

impl MigrationEngine {
    /// Every engine, in the order above.
    pub const ALL: [MigrationEngine; 4] =
        [MigrationEngine::Serial, MigrationEngine::Overlap, MigrationEngine::Zerocopy, MigrationEngine::Local];

    /// The engine a migration takes when none is named: the fastest the transport allows.
    /// Zero-copy sends, except over TLS, where encryption is a copy anyway and `zerocopy` is
    /// refused: the copying pipeline.
    pub fn default_for(tls: bool) -> MigrationEngine {
        if tls {
            MigrationEngine::Overlap
        } else {
            MigrationEngine::Zerocopy
        }
    }

    /// Connections when none are given: four for the pipelined engines, one for `serial` (one
    /// batch in flight) and `local` (no pages travel). On the project's 2-core hosts two
    /// connections reach 1.3-1.6x one's rate, and four took a flat-out 512 MiB guest across in
    /// 174-178 ms instead of 251-309 at 30 ms, host-timed (`kumo bench migrate --quick`,
    /// docs/migration.md); eight took no less time and left a guest writing at a fixed rate less
    /// of its CPU.
    pub fn default_connections(self) -> usize {
        match self {
            MigrationEngine::Overlap | MigrationEngine::Zerocopy => 4,
            MigrationEngine::Serial | MigrationEngine::Local => 1,
        }
    }

    /// The engine's name, as serde, clap and `Display` write it.
    pub fn name(self) -> &'static str {
        match self {
            MigrationEngine::Serial => "serial",
            MigrationEngine::Overlap => "overlap",
            MigrationEngine::Zerocopy => "zerocopy",
            MigrationEngine::Local => "local",
        }
    }
}

impl std::str::FromStr for MigrationEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        MigrationEngine::ALL
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown engine `{s}`: serial, overlap, zerocopy or local"))
    }
}

impl std::fmt::Display for MigrationEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_agree_everywhere() {
        for e in MigrationEngine::ALL {
            assert_eq!(e.name().parse::<MigrationEngine>(), Ok(e));
            assert_eq!(serde_json::to_value(e).unwrap(), serde_json::json!(e.name()));
            assert_eq!(e.to_string(), e.name());
        }
        assert_eq!(MigrationEngine::default_for(false), MigrationEngine::Zerocopy);
        assert_eq!(MigrationEngine::default_for(true), MigrationEngine::Overlap);
        assert_eq!(MigrationEngine::Zerocopy.default_connections(), 4);
        assert_eq!(MigrationEngine::Serial.default_connections(), 1);
        let e = "warp".parse::<MigrationEngine>().unwrap_err();
        assert!(e.contains("unknown engine `warp`") && !e.contains('\n'), "{e}");
    }
}
