//! Linux through Cloud Hypervisor's routes (docs/ch-compat.md): an empty VMM is given the test
//! kernel in the older `VmConfig` form libvirt 9.0 sends (`kernel{path}`, `cmdline{args}`, a
//! disk), booted with `vm.boot`, and the kernel mounts its root from that disk and runs its
//! `/init`; it finds ACPI S5 (kumo's sleep registers), the VM pauses and resumes as CH's states
//! say, takes a power-button press, and ends
//! with `vm.shutdown` (the VMM then waits, as CH's does, until `vmm.shutdown`).
//!
//! Needs /dev/kvm and the test kernel; skips, saying why, without them. Run it under
//! `flock /tmp/kumo-linux.lock` (one Linux VM at a time on this host). Waits are for console
//! lines, bounded only as hang guards.

use kumo_api::ApiClient;
use kumo_testkit::linux::{self, RootFs, RUN_INIT};
use kumo_testkit::{eventually, Kid, TestDir, PATIENCE};
use serde_json::{json, Value};
use std::path::Path;

fn ch(sock: &Path, method: &str, route: &str, body: Option<Value>) -> (u16, Value) {
    let (status, body) = ApiClient::new(sock)
        .request(method, &format!("/api/v1/{route}"), body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {route}: {e}"));
    (status, body.unwrap_or(Value::Null))
}

#[test]
fn linux_boots_through_chs_routes() {
    let test = "linux_boots_through_chs_routes";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let _one = linux::one_at_a_time();
    let dir = TestDir::new();
    let root = RootFs::create(dir.path("").as_path(), 32);
    let sock = dir.path("ch.sock");
    let mut vmm = Kid::spawn(&["run", "--api-socket", sock.to_str().unwrap()]).named("ch-linux");
    eventually(PATIENCE, || (sock.exists() && ApiClient::new(&sock).ping().is_ok()).then_some(()));
    let config = json!({
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 512u64 << 20},
        "kernel": {"path": kernel.to_str().unwrap()},
        "cmdline": {"args": linux::cmdline(linux::ROOT_ARGS)},
        "disks": [{"path": root.image.to_str().unwrap(), "readonly": false}],
        "serial": {"mode": "Tty"}, "console": {"mode": "Off"}
    });
    let put = |route: &str, body: Option<Value>| {
        let (status, b) = ch(&sock, "PUT", route, body);
        assert_eq!(status, 204, "{route}: {b}");
    };
    put("vm.create", Some(config));
    put("vm.boot", None);
    // Linux found \_S5 and the FADT's sleep registers: its power-off (after the power button,
    // in a guest with userspace) ends the VM through them.
    linux::expect_console(&mut vmm, "ACPI: PM: (supports S0 S5)");
    linux::expect_console(&mut vmm, "EXT4-fs (vda): mounted filesystem");
    linux::expect_console(&mut vmm, RUN_INIT);
    let (_, info) = ch(&sock, "GET", "vm.info", None);
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(info["kumo"]["disks"][0]["driver_ok"], true, "{info}");
    put("vm.pause", None);
    assert_eq!(ch(&sock, "GET", "vm.info", None).1["state"], "Paused");
    put("vm.resume", None);
    assert_eq!(ch(&sock, "GET", "vm.info", None).1["state"], "Running");
    // The GED raises its interrupt; this kernel (no evdev, no userspace) does nothing more.
    put("vm.power-button", None);
    put("vm.shutdown", None);
    // The VMM outlives its VM (Cloud Hypervisor's model) until vmm.shutdown.
    eventually(PATIENCE, || (ch(&sock, "GET", "vm.info", None).1["state"] == "Shutdown").then_some(()));
    put("vmm.shutdown", None);
    let (code, out, err) = vmm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("Kernel panic"), "{out}");
}
