//! docs/openapi.yaml is exactly what the server does: it lists exactly the server's routes, and
//! every route, called on real VMs, answers with a documented status and a body that fits the
//! documented schema (objects closed: a field the document does not describe fails). Request
//! bodies with every field set fit their documented schemas too.

#[path = "openapi/http.rs"]
mod http;
#[path = "openapi/schema.rs"]
mod schema;

use http::{exchange, Answer};
use kumo_testkit::*;
use schema::Spec;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::Path;

#[test]
fn the_document_describes_exactly_the_servers_routes() {
    let spec = Spec::load();
    let mut server: Vec<(String, String)> = kumo_api::routes().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    server.sort();
    assert_eq!(spec.routes(), server, "docs/openapi.yaml (left) against the server's route table (right)");
}

/// Calls routes on one VM's socket, checks every answer against the document and remembers
/// which routes it saw.
struct Caller<'a> {
    spec: &'a Spec,
    seen: BTreeSet<(String, String)>,
}

impl Caller<'_> {
    fn call(&mut self, socket: &Path, method: &str, path: &str, body: Option<Value>, want: u16) -> Answer {
        if let Some(b) = &body {
            self.check_request(method, path, b);
        }
        let text = body.map(|b| b.to_string());
        let a = exchange(socket, method, path, text.as_deref());
        let shown = String::from_utf8_lossy(&a.body).into_owned();
        assert_eq!(a.status, want, "{method} {path}: {shown}");
        self.check_answer(method, path, &a);
        self.seen.insert((method.to_string(), path.to_string()));
        a
    }

    fn check_answer(&self, method: &str, path: &str, a: &Answer) {
        let media = a.content_type.as_deref().unwrap_or("application/json");
        match self.spec.response_schema(method, path, a.status, media) {
            None => assert!(a.body.is_empty(), "{method} {path} {}: undocumented body", a.status),
            Some(schema) if media == "application/x-ndjson" => {
                let text = String::from_utf8_lossy(&a.body);
                for line in text.lines() {
                    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                    let r = self.spec.check(schema, &v);
                    assert!(r.is_ok(), "{method} {path}: line {line}: {}", r.unwrap_err());
                }
            }
            Some(schema) => {
                let r = self.spec.check(schema, &a.json());
                assert!(r.is_ok(), "{method} {path} {}: {}\n{}", a.status, r.unwrap_err(), a.json());
            }
        }
    }

    fn check_request(&self, method: &str, path: &str, body: &Value) {
        let op = self.spec.operation(method, path);
        let schema = &op["requestBody"]["content"]["application/json"]["schema"];
        assert!(!schema.is_null(), "{method} {path}: the document describes no request body");
        let r = self.spec.check(schema, body);
        assert!(r.is_ok(), "{method} {path} request {body}: {}", r.unwrap_err());
    }

    /// Every route answers a wrong method with a documented 405, and a route with a body
    /// answers a malformed one with a documented 400.
    fn misuse_every_route(&mut self, socket: &Path) {
        for (method, path) in kumo_api::routes() {
            let wrong = if method == "GET" { "PUT" } else { "GET" };
            if kumo_api::routes().any(|(m, p)| p == path && m == wrong) {
                continue;
            }
            let a = exchange(socket, wrong, path, None);
            assert_eq!(a.status, 405, "{wrong} {path}");
            assert!(a.header("Allow").is_some_and(|v| v.contains(method)), "{wrong} {path}: Allow");
            self.check_answer(method, path, &a);
            if !self.spec.operation(method, path)["requestBody"].is_null() {
                let a = exchange(socket, method, path, Some("{not json"));
                assert_eq!(a.status, 400, "{method} {path} with a malformed body");
                self.check_answer(method, path, &a);
            }
        }
    }
}

fn api_up(socket: &Path) {
    eventually(PATIENCE, || {
        socket.exists().then(|| exchange(socket, "GET", "/api/v1/vmm.ping", None)).filter(|a| a.status == 200)
    });
}

#[test]
fn every_route_answers_as_the_document_says() {
    if !kvm_or_skip("every_route_answers_as_the_document_says") {
        return;
    }
    let spec = Spec::load();
    let mut c = Caller { spec: &spec, seen: BTreeSet::new() };
    let dir = TestDir::new();
    let sock = dir.path("src.sock");
    let s = sock.to_str().unwrap();
    // A disk, so vm.info's and vm.counters' disk entries meet the document too.
    let img = dir.path("disk.img");
    std::fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
    let disk = format!("path={}", img.display());
    let src = Kid::spawn(&[
        "run",
        "--disk",
        &disk,
        "--guest",
        "memtouch",
        "pages=256",
        "until_input=1",
        "--memory",
        "64M",
        "--api-socket",
        s,
        "--numa",
        "node=0,cpus=0,memory=64M",
    ]);
    src.wait_stdout("memtouch: pages=", PATIENCE);
    api_up(&sock);

    // The VM before any migration.
    c.call(&sock, "GET", "/api/v1/vmm.ping", None, 200);
    let info = c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json();
    assert_eq!(info["kumo"]["pv"]["realtime"], false, "an unpinned vCPU gets the shared PV defaults: {info}");
    assert_eq!(info["kumo"]["disks"][0]["id"], "disk0", "{info}");
    let counters = c.call(&sock, "GET", "/api/v1/vm.counters", None, 200).json();
    assert!(counters["disks"]["disk0"].is_object(), "{counters}");
    c.call(&sock, "GET", "/api/v1/vm.migration", None, 200);
    c.call(&sock, "GET", "/api/v1/vm.migration-events", None, 200);
    c.call(&sock, "PUT", "/api/v1/vm.cancel-migration", None, 409);
    c.call(&sock, "PUT", "/api/v1/vm.pause", None, 204);
    c.call(&sock, "PUT", "/api/v1/vm.pause", None, 409);
    assert_eq!(c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json()["state"], "Paused");
    c.call(&sock, "PUT", "/api/v1/vm.resume", None, 204);
    c.call(&sock, "PUT", "/api/v1/vm.resume", None, 409);
    // Re-pinning: while running, paused and unpinned; a vCPU or host CPU that is not there: 400.
    c.call(&sock, "PUT", "/api/v1/vm.pin", Some(json!({"vcpu": 0, "cpu": 0})), 204);
    c.call(&sock, "PUT", "/api/v1/vm.pin", Some(json!({"vcpu": 1, "cpu": 0})), 400);
    c.call(&sock, "PUT", "/api/v1/vm.pin", Some(json!({"vcpu": 0, "cpu": 4095})), 400);
    assert_eq!(c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json()["kumo"]["vcpu_pins"], json!([0]));
    c.call(&sock, "PUT", "/api/v1/vm.pin", Some(json!({"vcpu": 0, "cpu": null})), 204);
    // One vCPU: keeping it is a no-op, more or none is refused (tests/linux_cpu_hotplug.rs ejects).
    c.call(&sock, "PUT", "/api/v1/vm.resize", Some(json!({"desired_vcpus": 1, "timeout_ms": 1000})), 204);
    c.call(&sock, "PUT", "/api/v1/vm.resize", Some(json!({"desired_vcpus": 2})), 400);
    assert_eq!(c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json()["kumo"]["parked_vcpus"], json!([]));
    // No --memory-zone: no zone to resize (tests/linux_virtio_mem.rs resizes real ones).
    c.call(&sock, "PUT", "/api/v1/vm.resize-zone", Some(json!({"id": "mem0", "desired_size": 0})), 404);
    let snap = dir.path("vm.snap");
    c.call(&sock, "PUT", "/api/v1/vm.snapshot", Some(json!({ "path": snap.to_str().unwrap() })), 200);
    c.call(&sock, "PUT", "/api/v1/vm.snapshot", Some(json!({ "path": "relative.snap" })), 400);
    let dry = json!({ "to": "tcp:127.0.0.1:1", "dry_run": true, "estimate_ms": 200 });
    c.call(&sock, "PUT", "/api/v1/vm.send-migration", Some(dry), 200);
    c.call(&sock, "PUT", "/api/v1/vm.send-migration", Some(json!({ "to": "nowhere" })), 400);
    c.call(&sock, "GET", "/api/v1/vm.elastic", None, 409);
    c.misuse_every_route(&sock);

    elastic_routes(&mut c, &dir);

    // A destination answers while it waits for the VM, then with the VM that arrived.
    let dsock = dir.path("dst.sock");
    let listen = format!("unix:{}", dir.path("mig.sock").display());
    let dst = Kid::spawn(&["run", "--incoming", &listen, "--api-socket", dsock.to_str().unwrap(), "--disk", &disk]);
    api_up(&dsock);
    assert_eq!(c.call(&dsock, "GET", "/api/v1/vm.info", None, 200).json()["kumo"]["state"], "receiving");
    c.call(&dsock, "GET", "/api/v1/vm.migration", None, 200);
    c.call(&dsock, "PUT", "/api/v1/vm.pause", None, 409);
    eventually(PATIENCE, || dir.path("mig.sock").exists().then_some(()));

    let req = json!({ "to": listen, "engine": "overlap", "connections": 2, "downtime_ms": 300, "xen": true,
        "progress_timeout_ms": 60000, "max_bandwidth": 1_000_000_000u64 });
    let done = c.call(&sock, "PUT", "/api/v1/vm.send-migration", Some(req), 200).json();
    assert_eq!(done["state"], "completed", "{done}");
    let (code, _, err) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "the source stops once its VM has moved: {err}");

    eventually(PATIENCE, || {
        let a = exchange(&dsock, "GET", "/api/v1/vm.info", None);
        (a.status == 200 && a.json()["state"] == "Running").then_some(())
    });
    assert_eq!(c.call(&dsock, "GET", "/api/v1/vm.migration", None, 200).json()["state"], "received");
    c.call(&dsock, "GET", "/api/v1/vm.counters", None, 200);
    c.call(&dsock, "PUT", "/api/v1/vm.shutdown", None, 204);
    let (code, _, err) = dst.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");

    empty_vmm_routes(&mut c, &dir, &snap, &img);
    ch_routes(&mut c, &dir);

    let all: BTreeSet<(String, String)> = kumo_api::routes().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    let missed: Vec<_> = all.difference(&c.seen).collect();
    assert!(missed.is_empty(), "routes this test does not call: {missed:?}");
}

/// An elastic VM (docs/elastic.md): its memory moves out and back in; bad requests fail.
fn elastic_routes(c: &mut Caller, dir: &TestDir) {
    let esock = dir.path("elastic.sock");
    let elastic = Kid::spawn(&[
        "run",
        "--guest",
        "worker",
        "bsp_work=1",
        "--cpus",
        "2",
        "--memory",
        "64M",
        "--elastic",
        "cpus=,memory=16M",
        "--api-socket",
        esock.to_str().unwrap(),
    ]);
    api_up(&esock);
    eventually(PATIENCE, || {
        let a = exchange(&esock, "GET", "/api/v1/vm.elastic", None);
        (a.status == 200 && a.json()["progress"][0].as_u64() > Some(0)).then_some(())
    });
    let two_mib = json!({"memory_bytes": 2 << 20, "timeout_ms": 60000});
    let released = c.call(&esock, "PUT", "/api/v1/vm.release", Some(two_mib), 200).json();
    assert_eq!(released["memory"]["bytes"], 2 << 20, "{released}");
    let back = json!({"memory": released["memory"], "timeout_ms": 60000});
    c.call(&esock, "PUT", "/api/v1/vm.acquire", Some(back), 200);
    c.call(&esock, "PUT", "/api/v1/vm.release", Some(json!({"cpus": 1})), 409);
    // A lend to a VM that is not there: given up here, taken back at once.
    let nowhere =
        json!({"to": dir.path("nowhere.sock").to_str().unwrap(), "memory_bytes": 2 << 20, "timeout_ms": 60000});
    c.call(&esock, "PUT", "/api/v1/vm.lend", Some(nowhere), 409);
    c.call(&esock, "PUT", "/api/v1/vm.lend", Some(json!({"to": "/x"})), 400);
    c.call(&esock, "PUT", "/api/v1/vm.release", Some(json!({})), 400);
    let info = c.call(&esock, "GET", "/api/v1/vm.elastic", None, 200).json();
    assert_eq!(info["nodes"][0]["plugged_bytes"], 16 << 20, "{info}");
    c.call(&esock, "PUT", "/api/v1/vm.shutdown", None, 204);
    let (code, _, err) = elastic.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
}

/// An empty VMM: told to restore (a bad file first: 400, it stays empty), or to receive.
fn empty_vmm_routes(c: &mut Caller, dir: &TestDir, snap: &Path, img: &Path) {
    let esock = dir.path("empty.sock");
    let empty = Kid::spawn(&["run", "--api-socket", esock.to_str().unwrap()]);
    api_up(&esock);
    assert_eq!(c.call(&esock, "GET", "/api/v1/vm.info", None, 200).json()["state"], "Created");
    c.call(&esock, "PUT", "/api/v1/vm.pause", None, 409);
    c.call(&esock, "PUT", "/api/v1/vm.restore", Some(json!({ "source_url": "/nonexistent/vm.snap" })), 400);
    let url = format!("file://{}", snap.display());
    // The snapshot's VM has one disk, disk0: an image for a disk it lacks is refused. (Given no
    // disks and no NICs, a restore keeps the VM's own, as Cloud Hypervisor's does.)
    let wrong = json!([{ "id": "disk9", "path": img.to_str().unwrap() }]);
    c.call(&esock, "PUT", "/api/v1/vm.restore", Some(json!({ "source_url": url, "disks": wrong })), 400);
    let disks = json!([{ "id": "disk0", "path": img.to_str().unwrap() }]);
    let req = json!({ "source_url": url, "disks": disks });
    let restored = c.call(&esock, "PUT", "/api/v1/vm.restore", Some(req), 200).json();
    assert_eq!(restored["paused"], false, "{restored}");
    c.call(&esock, "PUT", "/api/v1/vm.restore", Some(json!({ "source_url": url })), 409);
    let recv = json!({ "receiver_url": format!("unix:{}", dir.path("never.sock").display()) });
    c.call(&esock, "PUT", "/api/v1/vm.receive-migration", Some(recv), 409);
    c.call(&esock, "PUT", "/api/v1/vm.shutdown", None, 204);
    let (code, _, err) = empty.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");

    let rsock = dir.path("receiver.sock");
    let receiver = Kid::spawn(&["run", "--api-socket", rsock.to_str().unwrap()]);
    api_up(&rsock);
    let recv = json!({ "receiver_url": format!("unix:{}", dir.path("recv.sock").display()), "memory": 64u64 << 20, "cpus": 1 });
    c.call(&rsock, "PUT", "/api/v1/vm.receive-migration", Some(recv.clone()), 204);
    assert_eq!(c.call(&rsock, "GET", "/api/v1/vm.info", None, 200).json()["kumo"]["state"], "receiving");
    c.call(&rsock, "GET", "/api/v1/vm.migration", None, 200);
    c.call(&rsock, "PUT", "/api/v1/vm.receive-migration", Some(recv), 409);
    receiver.signal("TERM");
    let (_, _, err) = receiver.finish(PATIENCE);
    assert!(err.contains("no VM yet; exiting"), "{err}");
}

/// Cloud Hypervisor's routes on an empty VMM: a VM created (a refused field first: 400),
/// deleted, created again, booted, driven and the VMM shut down (tests/ch_api_e2e.rs has more).
fn ch_routes(c: &mut Caller, dir: &TestDir) {
    let kernel = dir.path("hello.elf");
    std::fs::write(&kernel, kumo_guests::find("hello").unwrap().elf).unwrap();
    let sock = dir.path("ch.sock");
    let vmm = Kid::spawn(&["run", "--api-socket", sock.to_str().unwrap()]);
    api_up(&sock);
    let ping = c.call(&sock, "GET", "/api/v1/vmm.ping", None, 200).json();
    assert_eq!(ping["version"], kumo_api::CH_COMPAT_VERSION, "{ping}");
    let config = json!({"cpus": {"boot_vcpus": 1, "max_vcpus": 1}, "memory": {"size": 64u64 << 20},
        "payload": {"kernel": kernel.to_str().unwrap()}, "serial": {"mode": "Tty"}, "rng": {"src": "/dev/urandom"}});
    let mut refused = config.clone();
    refused["vdpa"] = json!([{"path": "/dev/vhost-vdpa-0"}]);
    c.call(&sock, "PUT", "/api/v1/vm.create", Some(refused), 400);
    c.call(&sock, "PUT", "/api/v1/vm.boot", None, 409);
    c.call(&sock, "PUT", "/api/v1/vm.create", Some(config.clone()), 204);
    c.call(&sock, "PUT", "/api/v1/vm.create", Some(config.clone()), 409);
    c.call(&sock, "PUT", "/api/v1/vm.delete", None, 204);
    c.call(&sock, "PUT", "/api/v1/vm.create", Some(config.clone()), 204);
    // Cold plug: a NIC added and removed again (its tap does not exist), a disk refused.
    c.call(&sock, "PUT", "/api/v1/vm.add-net", Some(json!({"tap": "nonexistent0", "num_queues": 2})), 204);
    c.call(&sock, "PUT", "/api/v1/vm.remove-device", Some(json!({"id": "net0"})), 204);
    c.call(&sock, "PUT", "/api/v1/vm.remove-device", Some(json!({"id": "net0"})), 404);
    c.call(&sock, "PUT", "/api/v1/vm.add-disk", Some(json!({"path": "/x.img", "iommu": true})), 400);
    let info = c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json();
    assert_eq!((&info["state"], &info["config"]), (&json!("Created"), &config), "{info}");
    c.call(&sock, "PUT", "/api/v1/vm.boot", None, 204);
    vmm.wait_stdout("Hello from kumo guest!", PATIENCE);
    let info = c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json();
    assert_eq!((&info["state"], info["memory_actual_size"].as_u64()), (&json!("Running"), Some(64 << 20)), "{info}");
    c.call(&sock, "PUT", "/api/v1/vm.power-button", None, 204);
    c.call(&sock, "PUT", "/api/v1/vm.add-net", Some(json!({"tap": "tap0"})), 400);
    c.call(&sock, "PUT", "/api/v1/vm.reboot", None, 204);
    assert_eq!(c.call(&sock, "GET", "/api/v1/vm.info", None, 200).json()["state"], json!("Running"), "rebooted");
    c.call(&sock, "PUT", "/api/v1/vmm.shutdown", None, 204);
    let (code, _, err) = vmm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
}

/// Every field of the request types, set: the document must describe each.
#[test]
fn request_bodies_with_every_field_fit_the_document() {
    let spec = Spec::load();
    let c = Caller { spec: &spec, seen: BTreeSet::new() };
    let full = kumo_api::MigrateRequest {
        to: "tcp:10.0.0.2:4444".into(),
        engine: Some(kumo_api::MigrationEngine::Zerocopy),
        downtime_ms: Some(50),
        xen: Some(false),
        connections: Some(4),
        dry_run: false,
        estimate_ms: Some(1000),
        measure_link: false,
        progress_timeout_ms: Some(15000),
        strict: Some(true),
        max_bandwidth: Some(100 << 20),
        tls_dir: Some("/etc/kumo/migration".into()),
        tls_server_name: Some("dst.example".into()),
    };
    c.check_request("PUT", "/api/v1/vm.send-migration", &serde_json::to_value(&full).unwrap());
    let release = kumo_api::ReleaseRequest {
        cpus: 1,
        host_cpus: vec![3],
        memory_bytes: 128 << 20,
        node: Some(0),
        to: Some("/run/a.sock".into()),
        timeout_ms: 500,
    };
    c.check_request("PUT", "/api/v1/vm.release", &serde_json::to_value(&release).unwrap());
    let acquire = kumo_api::AcquireRequest {
        host_cpus: vec![3],
        memory: Some(kumo_api::MemoryGrant { bytes: 128 << 20, node: 0, host_node: Some(0) }),
        from: Some("/run/b.sock".into()),
        timeout_ms: 500,
    };
    c.check_request("PUT", "/api/v1/vm.acquire", &serde_json::to_value(&acquire).unwrap());
    let lend = kumo_api::LendApiRequest {
        to: "/run/b.sock".into(),
        cpus: 1,
        memory_bytes: 128 << 20,
        node: Some(0),
        returning: true,
        timeout_ms: 500,
    };
    c.check_request("PUT", "/api/v1/vm.lend", &serde_json::to_value(&lend).unwrap());
    let resize = kumo_api::ResizeRequest { desired_vcpus: 1, timeout_ms: 30_000 };
    c.check_request("PUT", "/api/v1/vm.resize", &serde_json::to_value(&resize).unwrap());
    let snap = kumo_api::SnapshotRequest { path: "/var/lib/kumo/vm.snap".into(), destination_url: None };
    c.check_request("PUT", "/api/v1/vm.snapshot", &serde_json::to_value(&snap).unwrap());
    let recv = kumo_api::ReceiveMigrationRequest {
        receiver_url: "tcp:0.0.0.0:4444".into(),
        memory: Some(1 << 30),
        shared_memory: true,
        cpus: Some(2),
        net: vec![kumo_api::NicBackend { id: "net0".into(), tap: Some("tap0".into()), vhost_user: None }],
        numa: vec![kumo_api::NodeBinding { node: 0, host_node: Some(0) }],
        disks: vec![kumo_api::DiskPath { id: "disk0".into(), path: "/var/lib/kumo/root.img".into() }],
        tls_dir: Some("/etc/kumo/migration".into()),
        insecure: true,
    };
    c.check_request("PUT", "/api/v1/vm.receive-migration", &serde_json::to_value(&recv).unwrap());
    let restore = kumo_api::RestoreRequest {
        source_url: "file:///var/lib/kumo/vm.snap".into(),
        net: vec![kumo_api::NicBackend { id: "net0".into(), tap: None, vhost_user: Some("/run/nb.sock".into()) }],
        numa: vec![kumo_api::NodeBinding { node: 1, host_node: None }],
        disks: vec![kumo_api::DiskPath { id: "data".into(), path: "/var/lib/kumo/data.img".into() }],
        net_fds: vec![kumo_api::RestoredNetFds {
            id: "net1".into(),
            num_fds: 1,
            fds: Some(vec![-1]),
            tap_fds: Default::default(),
        }],
    };
    c.check_request("PUT", "/api/v1/vm.restore", &serde_json::to_value(&restore).unwrap());
}
