//! What a snapshot of a running VM holds, and the one way it is made: every component (the
//! VM-wide KVM state, each vCPU, each device) saves and restores itself through
//! `kumo_devices::Persist`. The vCPUs and the VM-wide state have typed fields; devices are kept
//! by component id ([`DeviceStates`], each a typed `kumo_devices::DeviceState` of its kind), so
//! a new device adds its state without a new field here.
//!
//! A snapshot is JSON in a snapshot file and on the migration wire (the `State` record,
//! docs/migration-format.md), encoded where those are written (`snapshot`, `migration`):
//! changing its shape is a new stream version.

use kumo_devices::{DeviceState, DeviceStates};
use kumo_vm::{VcpuState, VmState};
use serde::de::Error as _;

/// Everything needed to put a paused VM back where it was (memory stays in place).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The in-kernel irqchips, PIT and KVM clock (component `vm`).
    pub vm: VmState,
    /// Each vCPU's state, in vCPU order (components `vcpu0`, `vcpu1`, …).
    pub vcpus: Vec<VcpuState>,
    /// Every device's state, by component id (`com1`, …).
    #[serde(deserialize_with = "device_states")]
    pub devices: DeviceStates,
    /// The user had paused the VM: a migrated VM arrives paused, as it left.
    pub paused: bool,
}

/// Decodes the device states naming the id of one that does not decode.
fn device_states<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DeviceStates, D::Error> {
    struct ById;
    impl<'de> serde::de::Visitor<'de> for ById {
        type Value = DeviceStates;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("device states by component id")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<DeviceStates, A::Error> {
            let mut states = DeviceStates::new();
            while let Some(id) = m.next_key::<String>()? {
                let s: DeviceState =
                    m.next_value().map_err(|e| A::Error::custom(format!("{id}: saved state does not fit: {e}")))?;
                states.insert(id, s);
            }
            Ok(states)
        }
    }
    d.deserialize_map(ById)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_state_that_does_not_decode_is_refused_with_its_id() {
        // Only the devices: the document is decoded in its order, they fail first.
        let decode = |devices: &str| {
            let doc = format!(r#"{{"devices": {devices}}}"#);
            serde_json::from_str::<Snapshot>(&doc).err().expect("refused").to_string()
        };
        let e = decode(r#"{"com1": {"serial": 7}}"#);
        assert!(e.starts_with("com1: saved state does not fit: invalid type"), "{e}");
        let e = decode(r#"{"pci-root": {"floppy": {}}}"#);
        assert!(e.starts_with("pci-root: saved state does not fit: unknown variant `floppy`"), "{e}");
    }
}
