//! Cloud Hypervisor's API on kumo (docs/ch-compat.md): an empty VMM (`kumo run --api-socket S`)
//! driven with CH's raw JSON bodies, in both `VmConfig` forms, as libvirt's `ch` driver and
//! CH's clients send them. The guest is kumo's `hello` program, whose ELF has a PVH entry and
//! boots as a kernel (`payload.kernel`): it prints and then spins, so the VM runs until told.

use kumo_api::ApiClient;
use kumo_testkit::*;
use serde_json::{json, Value};
use std::path::Path;

/// One CH call: the status and the JSON body, if any.
fn ch(sock: &Path, method: &str, route: &str, body: Option<Value>) -> (u16, Value) {
    let c = ApiClient::new(sock);
    let (status, body) = c
        .request(method, &format!("/api/v1/{route}"), body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {route}: {e}"));
    (status, body.unwrap_or(Value::Null))
}

fn ok(sock: &Path, route: &str, body: Option<Value>) {
    let (status, b) = ch(sock, "PUT", route, body);
    assert_eq!(status, 204, "{route}: {b}");
}

fn state(sock: &Path) -> Value {
    let (status, info) = ch(sock, "GET", "vm.info", None);
    assert_eq!(status, 200, "{info}");
    info["state"].clone()
}

/// An empty VMM on `dir`/ch.sock and the hello guest's ELF as a kernel file.
fn empty_vmm(dir: &TestDir) -> (Kid, std::path::PathBuf, String) {
    empty_vmm_with(dir, "")
}

/// [`empty_vmm`] with the test hooks `hooks` (`KUMO_TEST_HOOK`).
fn empty_vmm_with(dir: &TestDir, hooks: &str) -> (Kid, std::path::PathBuf, String) {
    let kernel = dir.path("hello.elf");
    std::fs::write(&kernel, kumo_guests::find("hello").unwrap().elf).unwrap();
    let sock = dir.path("ch.sock");
    let mut cmd = std::process::Command::new(kumo_bin());
    cmd.env("KUMO_TEST_HOOK", hooks).args(["run", "--api-socket", sock.to_str().unwrap()]);
    let vmm = Kid::spawn_cmd(&mut cmd);
    eventually(PATIENCE, || (sock.exists() && ApiClient::new(&sock).ping().is_ok()).then_some(()));
    (vmm, sock, kernel.to_str().unwrap().to_string())
}

#[test]
fn the_current_form_creates_boots_pauses_resumes_and_shuts_down() {
    if !kvm_or_skip("the_current_form_creates_boots_pauses_resumes_and_shuts_down") {
        return;
    }
    let dir = TestDir::new();
    // The VMM is slow to become empty after a VM ends: vm.boot right after vm.info said
    // Shutdown still finds it bootable (it waits for the VMM, as CH's clients expect).
    let (vmm, sock, kernel) = empty_vmm_with(&dir, "slow:vm-ended");
    let img = dir.path("disk.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let (status, ping) = ch(&sock, "GET", "vmm.ping", None);
    assert_eq!((status, &ping["version"]), (200, &json!(kumo_api::CH_COMPAT_VERSION)), "{ping}");
    assert!(ping["pid"].as_u64().is_some() && ping["kumo_version"].is_string(), "{ping}");
    let config = json!({
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2, "kvm_hyperv": false},
        "memory": {"size": 64u64 << 20, "shared": true, "hugepages": false},
        "payload": {"kernel": kernel, "cmdline": "quiet"},
        // CH's defaults of what kumo maps are written out in vm.info, as CH does.
        "disks": [{"path": img.to_str().unwrap(), "readonly": true, "direct": false, "iommu": false}],
        "serial": {"mode": "Tty"}, "console": {"mode": "Off"},
        "rng": {"src": "/dev/urandom"}, "watchdog": false, "iommu": false, "pvpanic": false,
        "platform": {"num_pci_segments": 1}
    });
    let mut plain = config.clone();
    plain["disks"] = json!([]);
    ok(&sock, "vm.create", Some(plain));
    // The disk comes by cold plug (a refused field first), as libvirt adds disks.
    let disk = config["disks"][0].clone();
    let (status, e) = ch(&sock, "PUT", "vm.add-disk", Some(json!({"path": disk["path"], "vhost_user": true})));
    assert!(status == 400 && e["error"].as_str().unwrap().contains("vm.add-disk: field `vhost_user`"), "{e}");
    ok(&sock, "vm.add-disk", Some(disk));
    assert_eq!(state(&sock), "Created");
    ok(&sock, "vm.boot", None);
    vmm.wait_stdout("Hello from kumo guest!", PATIENCE);
    let (_, info) = ch(&sock, "GET", "vm.info", None);
    assert_eq!((&info["state"], &info["config"]), (&json!("Running"), &config), "the config as created: {info}");
    assert_eq!(info["memory_actual_size"], 64u64 << 20, "{info}");
    assert_eq!(info["kumo"]["memory_private"], json!(false), "`shared: true` is the memfd: {info}");
    let disk0 = &info["device_tree"]["disk0"];
    assert_eq!((&disk0["id"], &disk0["pci_bdf"]), (&json!("disk0"), &info["kumo"]["disks"][0]["pci"]), "{info}");
    assert_eq!((&info["kumo"]["vcpus"], &info["kumo"]["disks"][0]["readonly"]), (&json!(2), &json!(true)), "{info}");
    // kumo's own client and CLI read kumo's part, as before.
    assert_eq!(ApiClient::new(&sock).info().unwrap().vcpus, 2);
    assert_eq!(vm_state(sock.to_str().unwrap()).as_deref(), Some("running"));
    ok(&sock, "vm.pause", None);
    assert_eq!(state(&sock), "Paused");
    ok(&sock, "vm.resume", None);
    assert_eq!(state(&sock), "Running");
    // A second create or boot on a VMM with a VM is a conflict.
    assert_eq!(ch(&sock, "PUT", "vm.create", Some(config.clone())).0, 409);
    assert_eq!(ch(&sock, "PUT", "vm.boot", None).0, 409);
    assert_eq!(ch(&sock, "PUT", "vm.remove-device", Some(json!({"id": "disk0"}))).0, 400, "no hot-plug");
    ok(&sock, "vm.power-button", None);
    // vm.reboot builds the VM again in this process (its guest starts over and greets again;
    // the disk's lock was released by the old VM) and answers once it runs.
    let hellos = || vmm.stdout().matches("Hello from kumo guest!").count();
    // A pin keeps the VMM's other threads, the API's among them, off host CPU 1; the VM the
    // reboot builds (from such a thread) still floats its unpinned vCPUs over all the VMM's CPUs.
    let all = kumo_vm::sched::thread_affinity().unwrap();
    let two_cpus = all.contains(&0) && all.contains(&1);
    if two_cpus {
        ok(&sock, "vm.pin", Some(json!({"vcpu": 0, "cpu": 1})));
    }
    ok(&sock, "vm.reboot", None);
    assert_eq!(state(&sock), "Running");
    eventually(PATIENCE, || (hellos() >= 2).then_some(()));
    if two_cpus {
        let every = kumo_vmm::placement::format_cpulist(&all);
        let vcpus: Vec<String> =
            thread_cpus(vmm.id()).into_iter().filter(|(n, _)| n.starts_with("vcpu")).map(|(_, c)| c).collect();
        assert_eq!(vcpus, [every.clone(), every], "the rebuilt VM's vCPUs float over every CPU");
    }
    assert_eq!(ch(&sock, "GET", "vm.info", None).1["config"], config, "the same config");
    // CH's VMM outlives its VM: shut down, it waits; vm.boot starts it again.
    ok(&sock, "vm.shutdown", None);
    eventually(PATIENCE, || (state(&sock) == "Shutdown").then_some(()));
    ok(&sock, "vm.boot", None);
    eventually(PATIENCE, || (hellos() >= 3).then_some(()));
    assert_eq!(state(&sock), "Running");
    ok(&sock, "vmm.shutdown", None);
    let (code, _, err) = vmm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("vm.create: ignoring") && err.contains("rng"), "the ignored fields are listed: {err}");
}

#[test]
fn the_older_form_libvirt_9_sends_boots_and_vmm_shutdown_ends_the_process() {
    if !kvm_or_skip("the_older_form_libvirt_9_sends_boots_and_vmm_shutdown_ends_the_process") {
        return;
    }
    let dir = TestDir::new();
    let (vmm, sock, kernel) = empty_vmm(&dir);
    // What libvirt 9.0's ch_monitor.c builds for a domain with a kernel and a PTY console.
    let config = json!({
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 32u64 << 20},
        "kernel": {"path": kernel},
        "cmdline": {"args": "console=ttyS0"},
        "console": {"mode": "Pty"}, "serial": {"mode": "Off"}
    });
    ok(&sock, "vm.create", Some(config));
    ok(&sock, "vm.boot", None);
    let (_, info) = ch(&sock, "GET", "vm.info", None);
    assert_eq!((&info["state"], &info["config"]["kernel"]["path"]), (&json!("Running"), &json!(kernel)), "{info}");
    assert_eq!(info["kumo"]["guest"], format!("kernel:{kernel}"), "{info}");
    // The console is a pseudo-terminal (COM1 serves CH's console): vm.info names it, as CH
    // does, and the guest's output reads from it (buffered there until a client opens it).
    let pty = info["config"]["console"]["file"].as_str().unwrap_or_else(|| panic!("no PTY: {info}")).to_string();
    assert!(pty.starts_with("/dev/pts/"), "{info}");
    let mut term = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&pty).unwrap()
    };
    let mut seen = String::new();
    eventually(PATIENCE, || {
        let mut b = [0u8; 256];
        if let Ok(n) = std::io::Read::read(&mut term, &mut b) {
            seen.push_str(&String::from_utf8_lossy(&b[..n]));
        }
        seen.contains("Hello from kumo guest!").then_some(())
    });
    assert!(!vmm.stdout().contains("Hello from kumo guest!"), "COM1 goes to the PTY, not stdout");
    ok(&sock, "vmm.shutdown", None);
    let (code, _, err) = vmm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn refused_fields_are_named_and_the_vmm_stays_usable() {
    if !kvm_or_skip("refused_fields_are_named_and_the_vmm_stays_usable") {
        return;
    }
    let dir = TestDir::new();
    let (vmm, sock, kernel) = empty_vmm(&dir);
    let base = json!({"payload": {"kernel": kernel}, "memory": {"size": 32u64 << 20}});
    let with = |field: &str, v: Value| {
        let mut c = base.clone();
        c[field] = v;
        c
    };
    for (body, named) in [
        (with("devices", json!([{"path": "/sys/bus/pci/devices/0000:01:00.0"}])), "`devices`"),
        (with("balloon", json!({"size": 1 << 20})), "`balloon`"),
        (with("cpus", json!({"boot_vcpus": 1, "max_vcpus": 4})), "`cpus.max_vcpus`"),
        (with("payload", json!({"kernel": kernel, "firmware": "/fw"})), "`payload.firmware`"),
        (with("net", json!([{"mac": "52:54:00:00:00:01"}])), "`net[0].tap`"),
        (with("a_field_of_ch_v99", json!({"on": true})), "`a_field_of_ch_v99`"),
    ] {
        let (status, e) = ch(&sock, "PUT", "vm.create", Some(body));
        let msg = e["error"].as_str().unwrap_or_default();
        assert!(status == 400 && msg.contains(named) && msg.contains("not supported by kumo"), "{named}: {e}");
    }
    // A kernel that is not there is the request's fault too.
    let (status, e) = ch(&sock, "PUT", "vm.create", Some(json!({"payload": {"kernel": "/nonexistent/vmlinux"}})));
    assert_eq!(status, 400, "{e}");
    // Nothing was created: boot is refused (and cold plug has nothing to plug into), and a
    // created VM can be deleted before it boots.
    assert_eq!(ch(&sock, "PUT", "vm.boot", None).0, 409);
    assert_eq!(ch(&sock, "PUT", "vm.add-disk", Some(json!({"path": "/x"}))).0, 404);
    ok(&sock, "vm.create", Some(with("devices", Value::Null)));
    let (_, info) = ch(&sock, "GET", "vm.info", None);
    assert_eq!((&info["state"], &info["config"]["payload"]["kernel"]), (&json!("Created"), &json!(kernel)), "{info}");
    ok(&sock, "vm.delete", None);
    assert!(ch(&sock, "GET", "vm.info", None).1["config"].is_null());
    assert_eq!(ch(&sock, "PUT", "vm.boot", None).0, 409);
    ok(&sock, "vmm.shutdown", None);
    let (code, _, err) = vmm.finish(PATIENCE);
    assert_eq!(code, Some(0), "an empty VMM ends cleanly on vmm.shutdown: {err}");
}

#[test]
fn snapshots_go_to_a_directory_and_migrations_take_chs_field_names() {
    if !kvm_or_skip("snapshots_go_to_a_directory_and_migrations_take_chs_field_names") {
        return;
    }
    let dir = TestDir::new();
    let (src, sock, kernel) = empty_vmm(&dir);
    ok(&sock, "vm.create", Some(json!({"payload": {"kernel": kernel}, "memory": {"size": 32u64 << 20}})));
    ok(&sock, "vm.boot", None);
    src.wait_stdout("Hello from kumo guest!", PATIENCE);
    // CH's snapshot: a directory URL; kumo writes its file in it.
    let snaps = dir.path("snap");
    std::fs::create_dir(&snaps).unwrap();
    let url = format!("file://{}", snaps.display());
    let (status, report) = ch(&sock, "PUT", "vm.snapshot", Some(json!({"destination_url": url})));
    assert_eq!(status, 200, "{report}");
    assert!(snaps.join("kumo-snapshot").is_file(), "{report}");
    let (status, e) = ch(&sock, "PUT", "vm.snapshot", Some(json!({"destination_url": "file:///nonexistent/dir"})));
    assert_eq!(status, 400, "{e}");

    // Restored from the directory in another empty VMM.
    let rsock = dir.path("restored.sock");
    let restored = Kid::spawn(&["run", "--api-socket", rsock.to_str().unwrap()]);
    eventually(PATIENCE, || (rsock.exists() && ApiClient::new(&rsock).ping().is_ok()).then_some(()));
    let (status, r) = ch(&rsock, "PUT", "vm.restore", Some(json!({"source_url": url})));
    assert_eq!(status, 200, "{r}");
    assert_eq!(state(&rsock), "Running");
    ok(&rsock, "vmm.shutdown", None);
    let (code, _, err) = restored.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");

    // CH's migration bodies: receiver_url on the destination, destination_url on the source.
    let dsock = dir.path("dst.sock");
    let dst = Kid::spawn(&["run", "--api-socket", dsock.to_str().unwrap()]);
    eventually(PATIENCE, || (dsock.exists() && ApiClient::new(&dsock).ping().is_ok()).then_some(()));
    let to = format!("unix:{}", dir.path("mig.sock").display());
    ok(&dsock, "vm.receive-migration", Some(json!({"receiver_url": to})));
    let (status, done) = ch(&sock, "PUT", "vm.send-migration", Some(json!({"destination_url": to})));
    assert_eq!((status, &done["state"]), (200, &json!("completed")), "{done}");
    let (code, _, err) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "the source ends once its VM moved: {err}");
    eventually(PATIENCE, || (state(&dsock) == "Running").then_some(()));
    ok(&dsock, "vmm.shutdown", None);
    let (code, _, err) = dst.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
}
