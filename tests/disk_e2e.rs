//! End to end: kumo's virtio-blk disk (`--disk`) with the `blkbench` guest. The guest writes its
//! pattern through the disk and the host reads it from the image file; a read-only disk answers
//! a write IOERR and its file stays as it was; a second VM that wants the same image for writing
//! is refused in one line; bad images and options are refused in one line; `vm.info` and
//! `vm.counters` show the disk; a disk under write load survives a migration and a snapshot.
//!
//! Needs /dev/kvm; skips without it. Every wait is for the guest's own output (or the VM's
//! state), bounded only as a safety net: no durations are asserted.

use kumo_testkit::*;

use std::path::Path;

const IMAGE_MIB: u64 = 32;

/// blkbench's pattern: word `i` of sector `s`.
fn word(sector: u64, i: u64, seed: u64) -> u64 {
    ((sector << 6) | i).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed
}

/// Sectors of the first `mib` MiB of `image` whose words are not the pattern of `seed`.
fn bad_sectors(image: &Path, mib: u64, seed: u64) -> usize {
    let img = std::fs::read(image).unwrap();
    (0..(mib << 11))
        .filter(|&s| {
            (0..64).any(|i| {
                let at = (s * 512 + i * 8) as usize;
                u64::from_le_bytes(img[at..at + 8].try_into().unwrap()) != word(s, i, seed)
            })
        })
        .count()
}

fn image(dir: &TestDir, name: &str, mib: u64) -> String {
    let p = dir.path(name);
    std::fs::File::create(&p).unwrap().set_len(mib << 20).unwrap();
    dir.arg(name)
}

/// `kumo run --guest blkbench` on `disk` (a --disk spec) with `args`, to its end.
fn blkbench(disk: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut argv = vec!["run", "--guest", "blkbench", "--memory", "128M", "--disk", disk];
    argv.extend_from_slice(args);
    Kid::spawn(&argv).finish(PATIENCE)
}

#[test]
fn the_guests_pattern_reaches_the_image_file_and_a_read_only_disk_refuses_writes() {
    if !kvm_or_skip("the_guests_pattern_reaches_the_image_file_and_a_read_only_disk_refuses_writes") {
        return;
    }
    let dir = TestDir::new();
    let img = image(&dir, "disk.img", IMAGE_MIB);
    let (code, out, err) = blkbench(&format!("path={img}"), &["size_mib=16", "ms=50", "seed=9"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("blkbench: done errors=0 verify_failures=0"), "{out}");
    for t in ["seq4k_read", "rand4k_read", "rand4k_write", "rand64k_write"] {
        assert!(out.contains(&format!("blkbench: {t} qd=32 ops=")), "{t}: {out}");
    }
    // The VM has stopped: the host reads the guest's pattern from the file.
    assert_eq!(bad_sectors(&dir.path("disk.img"), 16, 9), 0, "sectors that are not the guest's pattern");
    let before = std::fs::read(dir.path("disk.img")).unwrap();
    assert!(before[16 << 20..].iter().all(|&b| b == 0), "nothing written past the region");

    // Read-only: the pattern reads back, a write is answered IOERR, the file is unchanged.
    let ro = format!("path={img},readonly=on");
    let (code, out, err) = blkbench(&ro, &["size_mib=16", "ms=20", "seed=9", "readonly=1"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("blkbench: done errors=0 verify_failures=0"), "{out}");
    let (code, out, err) = blkbench(&ro, &["write_ro=1"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("blkbench: write on a read-only disk: status 1"), "{out}");
    assert!(std::fs::read(dir.path("disk.img")).unwrap() == before, "a read-only disk's image is unchanged");
}

#[test]
fn a_second_writer_is_refused_and_info_and_counters_show_the_disk() {
    if !kvm_or_skip("a_second_writer_is_refused_and_info_and_counters_show_the_disk") {
        return;
    }
    let dir = TestDir::new();
    let img = image(&dir, "shared.img", IMAGE_MIB);
    let sock = dir.arg("api.sock");
    let first = Kid::spawn(&[
        "run",
        "--guest",
        "blkbench",
        "--cpus",
        "2",
        "--memory",
        "128M",
        "--api-socket",
        &sock,
        "--disk",
        &format!("path={img},id=root,serial=kumo-e2e"),
        "size_mib=4",
        "ms=60000",
    ]);
    // The first pass lays the pattern down (4 MiB written) before the timed tests start.
    first.wait_stdout("blkbench: seq64k_write qd=", PATIENCE);

    // The first VM holds the image for writing: the second is refused at start, in one line.
    let o = kumo(&["run", "--guest", "blkbench", "--disk", &format!("path={img}")]);
    let (_, err) = text(&o);
    assert!(!o.status.success(), "{err}");
    let line = format!("disk image {img} is in use by another process (locked for writing)");
    assert!(err.contains(&line), "{err}");
    assert_eq!(err.trim().lines().filter(|l| l.contains("disk image")).count(), 1, "{err}");
    // Reading it is refused too while someone writes.
    let o = kumo(&["run", "--guest", "blkbench", "--disk", &format!("path={img},readonly=on")]);
    assert!(!o.status.success() && text(&o).1.contains("in use by another process"), "{}", text(&o).1);

    let info = vm_info(&sock);
    assert_eq!(info.disks.len(), 1, "{info:?}");
    let d = &info.disks[0];
    assert_eq!(
        (d.id.as_str(), d.path.as_str(), d.readonly, d.serial.as_str()),
        ("root", img.as_str(), false, "kumo-e2e")
    );
    assert_eq!((d.queues, d.queue_size, d.size), (2, 256, IMAGE_MIB << 20), "one queue per vCPU by default");
    assert!(d.driver_ok && d.pci.starts_with("0000:00:"), "{d:?}");
    let (ok, out, err) = kumo_api(&sock, &["counters"]);
    assert!(ok, "{err}");
    let c: kumo_api::Counters = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let dc = c.disks.get("root").unwrap_or_else(|| panic!("{out}"));
    assert!(dc.requests > 0 && dc.write_bytes >= 4 << 20 && dc.read_bytes > 0, "{dc:?}");
    assert_eq!(dc.errors, 0, "{dc:?}");

    assert!(kumo_api(&sock, &["shutdown"]).0);
    let (code, _, err) = first.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    // Its lock went with it.
    let (code, out, err) = blkbench(&format!("path={img}"), &["size_mib=1", "ms=1"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
}

#[test]
fn bad_images_and_options_are_refused_in_one_line() {
    if !kvm_or_skip("bad_images_and_options_are_refused_in_one_line") {
        return;
    }
    let dir = TestDir::new();
    let empty = image(&dir, "empty.img", 0);
    let qcow = dir.arg("disk.qcow2");
    let mut head = b"QFI\xfb\0\0\0\x03".to_vec();
    head.resize(1 << 20, 0);
    std::fs::write(&qcow, head).unwrap();
    let missing = dir.arg("missing.img");
    let good = image(&dir, "good.img", 1);
    let cases = [
        (format!("path={missing}"), format!("disk image {missing}: no such file")),
        (format!("path={qcow}"), format!("disk image {qcow}: is a qcow2 image; only raw images are supported")),
        (format!("path={empty}"), format!("disk image {empty}: is empty (zero length)")),
        (format!("path={}", dir.arg("")), "is a directory".to_string()),
        (format!("path={good},cache=none"), "unknown key `cache`".to_string()),
        (format!("path={good},readonly=maybe"), "readonly=`maybe`: on or off".to_string()),
        (format!("path={good},queues=0"), "queues=0 is not 1..=".to_string()),
        ("readonly=on".to_string(), "path=FILE is required".to_string()),
    ];
    for (spec, want) in cases {
        let o = kumo(&["run", "--guest", "blkbench", "--disk", &spec]);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{spec}: {err}");
        assert!(err.contains(&want), "{spec}: want `{want}` in:\n{err}");
        let errors = err.lines().filter(|l| l.contains("error") || l.contains("disk")).count();
        assert_eq!(errors, 1, "{spec}: one line:\n{err}");
    }
}

/// blkbench under an API socket on `img` (seed 5, an 8 MiB region, 1.5 s per test), waited for
/// until its timed write tests run: the guest writes whenever the test acts next.
/// `shared`: its memory a memfd (`--shared-memory`), for the local engine; else private.
fn writing_source(dir: &TestDir, img: &str, tag: &str, shared: bool) -> (Kid, String) {
    let sock = dir.arg(&format!("{tag}.sock"));
    let memory = if shared { "--shared-memory" } else { "--private-memory" };
    let src = Kid::spawn(&[
        "run",
        memory,
        "--guest",
        "blkbench",
        "--cpus",
        "2",
        "--memory",
        "128M",
        "--api-socket",
        &sock,
        "--disk",
        &format!("path={img}"),
        "size_mib=8",
        "ms=1500",
        "seed=5",
    ])
    .named(tag);
    src.wait_stdout("blkbench: seq4k_write qd=1 ", PATIENCE);
    (src, sock)
}

/// The guest on the destination (or the restored VM) finishes its tests and its last whole-region
/// check; then the host finds the pattern in the image too.
fn finishes_with_its_pattern(vm: Kid, dir: &TestDir, what: &str) {
    let (code, out, err) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{what}: {out}\n{err}");
    assert!(out.contains("blkbench: done errors=0 verify_failures=0"), "{what}: {out}");
    assert!(out.contains("blkbench: rand64k_write qd=32 ops="), "{what}: the write tests ran there: {out}");
    assert_eq!(bad_sectors(&dir.path("disk.img"), 8, 5), 0, "{what}: sectors that are not the guest's pattern");
}

#[test]
fn a_disk_under_write_load_migrates_locally_and_over_a_socket() {
    if !kvm_or_skip("a_disk_under_write_load_migrates_locally_and_over_a_socket") {
        return;
    }
    // Every engine: memory shared (local), sent by one or several connections, or zero-copy.
    for (engine, local) in [("local", true), ("serial", false), ("overlap", false), ("zerocopy", false)] {
        let dir = TestDir::new();
        let img = image(&dir, "disk.img", IMAGE_MIB);
        let addr =
            if local { format!("unix:{}", dir.arg("mig.sock")) } else { format!("tcp:127.0.0.1:{}", free_port()) };
        let dest = incoming(&addr, &["--disk", &format!("id=disk0,path={img}")], &format!("{engine}-dst"));
        let (src, sock) = writing_source(&dir, &img, &format!("{engine}-src"), local);
        let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", engine]);
        assert!(ok, "{engine}: {out}\n{err}\nsource:\n{}\ndest:\n{}", src.stderr(), dest.stderr());
        let (code, _, err) = src.finish(PATIENCE);
        assert_eq!(code, Some(0), "{engine}: {err}");
        assert!(err.contains("VM migrated to"), "{err}");
        finishes_with_its_pattern(dest, &dir, engine);
    }
}

#[test]
fn a_disk_survives_snapshot_and_restore_and_another_size_is_refused() {
    if !kvm_or_skip("a_disk_survives_snapshot_and_restore_and_another_size_is_refused") {
        return;
    }
    let dir = TestDir::new();
    let img = image(&dir, "disk.img", IMAGE_MIB);
    let (src, sock) = writing_source(&dir, &img, "snap-src", false);
    let file = dir.arg("vm.snap");
    let (ok, out, err) = kumo_api(&sock, &["snapshot", "--to", &file]);
    assert!(ok, "{out}\n{err}");
    assert!(kumo_api(&sock, &["shutdown"]).0);
    let (code, _, err) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");

    // Refused in one line: no image for the disk, an image of another size.
    let o = kumo(&["run", "--restore", &file]);
    let (_, err) = text(&o);
    assert!(
        !o.status.success() && err.contains("the VM's disk disk0") && err.contains("give --disk id=disk0,path=FILE"),
        "{err}"
    );
    let small = image(&dir, "small.img", 16);
    let o = kumo(&["run", "--restore", &file, "--disk", &format!("id=disk0,path={small}")]);
    let (_, err) = text(&o);
    let want =
        format!("disk disk0: image {small} is {} bytes; the VM's disk was {} bytes", 16u64 << 20, IMAGE_MIB << 20);
    assert!(!o.status.success() && err.contains(&want), "{err}");

    // The same through an empty VMM's vm.restore (`disks` in the request).
    let esock = dir.arg("empty.sock");
    let empty = Kid::spawn(&["run", "--api-socket", &esock]).named("empty");
    eventually(PATIENCE, || vm_state(&esock));
    let (ok, _, err) = kumo_api(&esock, &["restore", "--from", &file, "--disk", &format!("id=disk0,path={small}")]);
    assert!(!ok && err.contains(&want), "{err}");
    assert_eq!(vm_state(&esock).as_deref(), Some("created"), "the VMM stays empty");
    drop(empty);

    let vm = Kid::spawn(&["run", "--restore", &file, "--disk", &format!("id=disk0,path={img}")]).named("restored");
    finishes_with_its_pattern(vm, &dir, "restore");
}

/// A migration that fails after the source gave its image lock up (the destination cannot lock
/// its image: another VM reads it) gives the VM back to the source, which takes its lock again
/// and runs on: its guest finishes with its pattern and a second writer is still refused.
#[test]
fn a_failed_migration_gives_the_source_its_image_lock_back() {
    if !kvm_or_skip("a_failed_migration_gives_the_source_its_image_lock_back") {
        return;
    }
    let dir = TestDir::new();
    let img = image(&dir, "disk.img", IMAGE_MIB);
    let other = image(&dir, "other.img", IMAGE_MIB);
    let reader = Kid::spawn(&[
        "run",
        "--guest",
        "blkbench",
        "--memory",
        "128M",
        "--disk",
        &format!("path={other},readonly=on"),
        "readonly=1",
        "size_mib=1",
        "ms=600000",
    ])
    .named("reader");
    reader.wait_stdout("blkbench: disk of", PATIENCE);
    let addr = format!("unix:{}", dir.arg("mig.sock"));
    let mut dest = incoming(&addr, &["--disk", &format!("id=disk0,path={other}")], "fail-dst");
    let (src, sock) = writing_source(&dir, &img, "fail-src", true);
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "local"]);
    assert!(!ok, "{out}\n{err}");
    assert!(err.contains("in use by another process"), "{err}\ndest:\n{}", dest.stderr());
    let _ = dest.wait_exit(PATIENCE);
    assert_eq!(vm_state(&sock).as_deref(), Some("running"), "the source runs on");
    let o = kumo(&["run", "--guest", "blkbench", "--disk", &format!("path={img}")]);
    assert!(!o.status.success() && text(&o).1.contains("in use by another process"), "{}", text(&o).1);
    finishes_with_its_pattern(src, &dir, "source");
    drop(reader);
}
