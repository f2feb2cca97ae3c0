//! One persist pattern for every component of a VM: devices here, and the vCPUs and VM-wide
//! KVM state in `kumo-vm`. A component says under which id it is saved, gives its state as a
//! serde value, and takes one back. A snapshot keeps device states in a map keyed by id
//! ([`DeviceStates`]), so a new device adds its state to snapshots and migration without
//! touching a fixed struct.
//!
//! [`PersistDyn`] is the object-safe face of [`Persist`] (states as JSON values) that a device
//! manager keeps its devices behind; every `Persist` type has it.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Device states of a snapshot, keyed by component id.
pub type DeviceStates = BTreeMap<String, serde_json::Value>;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The component could not read or apply its state (a KVM call failed, a value is invalid).
    #[error("{id}: {msg}")]
    Component { id: String, msg: String },
    /// The saved state does not have the component's shape.
    #[error("{id}: saved state does not fit: {err}")]
    Format { id: String, err: serde_json::Error },
    #[error("the snapshot has no state for {0}")]
    Missing(String),
    #[error("the snapshot has state for {0}, which this VM lacks")]
    Unknown(String),
}

impl PersistError {
    pub fn component(id: impl Into<String>, msg: impl ToString) -> Self {
        PersistError::Component { id: id.into(), msg: msg.to_string() }
    }
}

/// A component whose state a snapshot carries.
pub trait Persist {
    type State: Serialize + DeserializeOwned;
    /// Its id in a snapshot: unique within a VM and stable across kumo versions (`com1`,
    /// `vcpu0`).
    fn id(&self) -> String;
    /// Its state now. The VM must be paused.
    fn save(&self) -> Result<Self::State, PersistError>;
    /// Puts back a state from [`Persist::save`]. A refused state leaves the component as it was
    /// where it can.
    fn restore(&mut self, state: &Self::State) -> Result<(), PersistError>;
}

/// [`Persist`] with states as JSON values, for a list of different components.
pub trait PersistDyn: Send {
    fn id(&self) -> String;
    fn save_value(&self) -> Result<serde_json::Value, PersistError>;
    fn restore_value(&mut self, state: serde_json::Value) -> Result<(), PersistError>;
}

impl<T: Persist + Send> PersistDyn for T {
    fn id(&self) -> String {
        Persist::id(self)
    }

    fn save_value(&self) -> Result<serde_json::Value, PersistError> {
        let s = self.save()?;
        serde_json::to_value(s).map_err(|err| PersistError::Format { id: Persist::id(self), err })
    }

    fn restore_value(&mut self, state: serde_json::Value) -> Result<(), PersistError> {
        let s = serde_json::from_value(state).map_err(|err| PersistError::Format { id: Persist::id(self), err })?;
        self.restore(&s)
    }
}

/// Checks that `states` holds exactly the ids of `components`: restoring a snapshot of a VM with
/// other devices is refused before anything changes.
pub fn check_ids<'a>(
    states: &DeviceStates,
    components: impl IntoIterator<Item = String> + 'a,
) -> Result<(), PersistError> {
    let ids: std::collections::BTreeSet<String> = components.into_iter().collect();
    if let Some(missing) = ids.iter().find(|id| !states.contains_key(*id)) {
        return Err(PersistError::Missing(missing.clone()));
    }
    if let Some(extra) = states.keys().find(|k| !ids.contains(*k)) {
        return Err(PersistError::Unknown(extra.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Counter(u32);

    impl Persist for Counter {
        type State = u32;
        fn id(&self) -> String {
            "counter".into()
        }
        fn save(&self) -> Result<u32, PersistError> {
            Ok(self.0)
        }
        fn restore(&mut self, s: &u32) -> Result<(), PersistError> {
            if *s > 100 {
                return Err(PersistError::component("counter", "above 100"));
            }
            self.0 = *s;
            Ok(())
        }
    }

    #[test]
    fn states_go_through_json_values_by_id() {
        let a = Counter(7);
        let mut states = DeviceStates::new();
        let dyns: Vec<&dyn PersistDyn> = vec![&a];
        for c in dyns {
            states.insert(c.id(), c.save_value().unwrap());
        }
        let json = serde_json::to_string(&states).unwrap();
        assert_eq!(json, r#"{"counter":7}"#);
        let back: DeviceStates = serde_json::from_str(&json).unwrap();
        let mut b = Counter::default();
        check_ids(&back, [PersistDyn::id(&b)]).unwrap();
        b.restore_value(back["counter"].clone()).unwrap();
        assert_eq!(b.0, 7);
    }

    #[test]
    fn misfits_are_refused_with_the_components_id() {
        let mut c = Counter(1);
        let e = c.restore_value(serde_json::json!("seven")).unwrap_err().to_string();
        assert!(e.starts_with("counter: saved state does not fit"), "{e}");
        assert_eq!(c.restore_value(serde_json::json!(101)).unwrap_err().to_string(), "counter: above 100");
        assert_eq!(c.0, 1);

        let states: DeviceStates = [("com1".to_string(), serde_json::json!(1))].into();
        let e = check_ids(&states, ["com1".to_string(), "net0".to_string()]).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has no state for net0");
        let e = check_ids(&states, []).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has state for com1, which this VM lacks");
    }
}
