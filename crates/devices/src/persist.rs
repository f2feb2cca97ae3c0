//! One persist pattern for every component of a VM: devices here, and the vCPUs and VM-wide
//! KVM state in `kumo-vm`. A component says under which id it is saved, gives its state as a
//! typed value, and takes one back. A snapshot keeps device states in a map keyed by id
//! ([`DeviceStates`]) of [`DeviceState`]s, one variant per kind of device, so a new device adds
//! its state to snapshots and migration with one variant and no new field elsewhere.
//!
//! [`PersistDyn`] is the object-safe face of [`Persist`] (states as [`DeviceState`]) that a
//! device manager keeps its devices behind; every `Persist` type whose state has a variant
//! ([`DeviceStateKind`]) has it. States are encoded (serde) only where a snapshot file or a
//! migration stream is written.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::apic::{IoApicState, PicState, UserLapicState};
use crate::pci::{PciConfigState, PciFunctionState};
use crate::serial::SerialSnapshot;
use crate::virtio::net::NetState;
use crate::virtio::pci_transport::TransportState;
use crate::virtio::VhostUserState;

/// Device states of a snapshot, keyed by component id.
pub type DeviceStates = BTreeMap<String, DeviceState>;

/// A virtio device's PCI function state: config space and MSI-X, the virtio transport, and the
/// device's own state `S` ([`crate::virtio::VirtioDevice::State`]).
pub type VirtioFunctionState<S> = PciFunctionState<TransportState<S>>;

/// One component's state in a snapshot, by kind. A new kind of device adds one variant here
/// and names it for its state type with [`device_state_kind!`] (a virtio device:
/// [`virtio_state_kind!`] for its `VirtioDevice::State`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceState {
    /// The 16550 UART (`com1`).
    Serial(SerialSnapshot),
    /// The PCI host bridge (`pci-root`).
    PciRoot(PciConfigState),
    /// A vCPU's user-mode LAPIC (`lapic<N>`, user irqchip).
    Lapic(UserLapicState),
    /// The user-mode IOAPIC (`ioapic`).
    #[serde(rename = "ioapic")]
    IoApic(IoApicState),
    /// The user-mode 8259 pair (`pic`).
    Pic(PicState),
    /// A virtio-net function on a kumo backend (`net<N>` on a tap).
    VirtioNet(VirtioFunctionState<NetState>),
    /// A virtio-net function served by a vhost-user backend (`net<N>`).
    VhostUserNet(VirtioFunctionState<VhostUserState>),
    VirtioBlock(VirtioFunctionState<crate::virtio::block::BlockState>),
    /// A virtio-mem function (`mem<N>`, one per `--memory-zone`).
    VirtioMem(VirtioFunctionState<crate::virtio::mem::MemState>),
    // Test devices' states.
    #[cfg(test)]
    TestCounter(u32),
    #[cfg(test)]
    TestNic(crate::pci::tests::NicState),
    #[cfg(test)]
    TestBlock(PciFunctionState<Vec<u8>>),
}

impl DeviceState {
    /// The kind's name, as the snapshot encodes it.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Serial(_) => "serial",
            DeviceState::PciRoot(_) => "pci-root",
            DeviceState::Lapic(_) => "lapic",
            DeviceState::IoApic(_) => "ioapic",
            DeviceState::Pic(_) => "pic",
            DeviceState::VirtioNet(_) => "virtio-net",
            DeviceState::VhostUserNet(_) => "vhost-user-net",
            DeviceState::VirtioBlock(_) => "virtio-blk",
            DeviceState::VirtioMem(_) => "virtio-mem",
            #[cfg(test)]
            DeviceState::TestCounter(_) | DeviceState::TestNic(_) | DeviceState::TestBlock(_) => "test",
        }
    }
}

/// A state type with its own [`DeviceState`] variant.
pub trait DeviceStateKind: Sized {
    fn into_device_state(self) -> DeviceState;
    /// The state if `s` is of this kind.
    fn of(s: &DeviceState) -> Option<&Self>;
}

/// Names the [`DeviceState`] variant of a state type: `device_state_kind!(Serial, SerialSnapshot)`.
#[macro_export]
macro_rules! device_state_kind {
    ($variant:ident, $ty:ty) => {
        impl $crate::persist::DeviceStateKind for $ty {
            fn into_device_state(self) -> $crate::persist::DeviceState {
                $crate::persist::DeviceState::$variant(self)
            }
            fn of(s: &$crate::persist::DeviceState) -> Option<&Self> {
                match s {
                    $crate::persist::DeviceState::$variant(x) => Some(x),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
        }
    };
}

/// Names the [`DeviceState`] variant of a virtio device's own state type (the variant holds
/// its PCI function's state): `virtio_state_kind!(VirtioNet, NetState)`.
#[macro_export]
macro_rules! virtio_state_kind {
    ($variant:ident, $ty:ty) => {
        impl $crate::virtio::VirtioState for $ty {
            fn into_device_state(s: $crate::persist::VirtioFunctionState<Self>) -> $crate::persist::DeviceState {
                $crate::persist::DeviceState::$variant(s)
            }
            fn of(s: &$crate::persist::DeviceState) -> Option<&$crate::persist::VirtioFunctionState<Self>> {
                match s {
                    $crate::persist::DeviceState::$variant(x) => Some(x),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
        }
    };
}

impl<S: crate::virtio::VirtioState> DeviceStateKind for VirtioFunctionState<S> {
    fn into_device_state(self) -> DeviceState {
        S::into_device_state(self)
    }
    fn of(s: &DeviceState) -> Option<&Self> {
        S::of(s)
    }
}

device_state_kind!(Serial, SerialSnapshot);
device_state_kind!(PciRoot, PciConfigState);
device_state_kind!(Lapic, UserLapicState);
device_state_kind!(IoApic, IoApicState);
device_state_kind!(Pic, PicState);
virtio_state_kind!(VirtioNet, NetState);
virtio_state_kind!(VhostUserNet, VhostUserState);
virtio_state_kind!(VirtioBlock, crate::virtio::block::BlockState);
virtio_state_kind!(VirtioMem, crate::virtio::mem::MemState);
#[cfg(test)]
device_state_kind!(TestCounter, u32);
#[cfg(test)]
device_state_kind!(TestNic, crate::pci::tests::NicState);
#[cfg(test)]
device_state_kind!(TestBlock, PciFunctionState<Vec<u8>>);

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The component could not read or apply its state (a KVM call failed, a value is invalid).
    #[error("{id}: {msg}")]
    Component { id: String, msg: String },
    /// The saved state is of another kind of component.
    #[error("{id}: saved state is a {found} state, not this component's")]
    Kind { id: String, found: &'static str },
    #[error("the snapshot has no state for {0}")]
    Missing(String),
    #[error("the snapshot has state for {0}, which this VM lacks")]
    Unknown(String),
}

impl PersistError {
    pub fn component(id: impl Into<String>, msg: impl ToString) -> Self {
        PersistError::Component { id: id.into(), msg: msg.to_string() }
    }

    /// `state` is not of component `id`'s kind.
    pub fn kind(id: impl Into<String>, state: &DeviceState) -> Self {
        PersistError::Kind { id: id.into(), found: state.kind() }
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

/// [`Persist`] with states as [`DeviceState`]s, for a list of different components.
pub trait PersistDyn: Send {
    fn id(&self) -> String;
    fn save_dyn(&self) -> Result<DeviceState, PersistError>;
    /// Refuses a state of another kind than this component's ([`PersistError::Kind`]), so a
    /// restore can check every component before it changes any.
    fn check_kind(&self, state: &DeviceState) -> Result<(), PersistError>;
    /// Puts back a state of this component's kind; another kind is refused as by
    /// [`PersistDyn::check_kind`].
    fn restore_dyn(&mut self, state: &DeviceState) -> Result<(), PersistError>;
}

impl<T: Persist + Send> PersistDyn for T
where
    T::State: DeviceStateKind,
{
    fn id(&self) -> String {
        Persist::id(self)
    }

    fn save_dyn(&self) -> Result<DeviceState, PersistError> {
        Ok(self.save()?.into_device_state())
    }

    fn check_kind(&self, state: &DeviceState) -> Result<(), PersistError> {
        T::State::of(state).map(|_| ()).ok_or_else(|| PersistError::kind(Persist::id(self), state))
    }

    fn restore_dyn(&mut self, state: &DeviceState) -> Result<(), PersistError> {
        let s = T::State::of(state).ok_or_else(|| PersistError::kind(Persist::id(self), state))?;
        self.restore(s)
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
    fn states_go_through_device_states_by_id() {
        let a = Counter(7);
        let mut states = DeviceStates::new();
        let dyns: Vec<&dyn PersistDyn> = vec![&a];
        for c in dyns {
            states.insert(c.id(), c.save_dyn().unwrap());
        }
        // The encoding names each state's kind.
        let json = serde_json::to_string(&states).unwrap();
        assert_eq!(json, r#"{"counter":{"test-counter":7}}"#);
        let back: DeviceStates = serde_json::from_str(&json).unwrap();
        let mut b = Counter::default();
        check_ids(&back, [PersistDyn::id(&b)]).unwrap();
        b.restore_dyn(&back["counter"]).unwrap();
        assert_eq!(b.0, 7);
    }

    #[test]
    fn misfits_are_refused_with_the_components_id() {
        let mut c = Counter(1);
        let pic = DeviceState::Pic(crate::apic::Pic::new().save().unwrap());
        let e = c.restore_dyn(&pic).unwrap_err().to_string();
        assert_eq!(e, "counter: saved state is a pic state, not this component's");
        assert_eq!(c.check_kind(&pic).unwrap_err().to_string(), e);
        c.check_kind(&DeviceState::TestCounter(101)).unwrap();
        let e = c.restore_dyn(&DeviceState::TestCounter(101)).unwrap_err().to_string();
        assert_eq!(e, "counter: above 100");
        assert_eq!(c.0, 1);

        let states: DeviceStates = [("com1".to_string(), DeviceState::TestCounter(1))].into();
        let e = check_ids(&states, ["com1".to_string(), "net0".to_string()]).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has no state for net0");
        let e = check_ids(&states, []).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has state for com1, which this VM lacks");
    }

    #[test]
    fn kinds_are_named_as_encoded() {
        let states = [
            DeviceState::PciRoot(crate::pci::PciRoot::new().save().unwrap()),
            DeviceState::IoApic(crate::apic::IoApic::new().save().unwrap()),
            DeviceState::Pic(crate::apic::Pic::new().save().unwrap()),
        ];
        for s in states {
            let v = serde_json::to_value(&s).unwrap();
            assert_eq!(v.as_object().unwrap().keys().collect::<Vec<_>>(), [s.kind()]);
        }
    }
}
