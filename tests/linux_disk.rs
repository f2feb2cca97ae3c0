//! Linux as the judge of kumo's virtio-blk disk: the test kernel (`scripts/build-test-kernel.sh`)
//! mounts an ext4 root filesystem from a kumo disk the test builds (`mkfs.ext4 -d`), reads and
//! runs its syscall-free `/init` from it, and its writes land in the image: the MMP block its
//! kmmpd thread rewrites every second changes in the file while it runs, and after the VM stops
//! the mount count is raised and the filesystem (its journal replayed on a copy) is clean.
//!
//! Needs /dev/kvm and the test kernel; skips, saying why, without them (under CI a missing
//! kernel fails). Every wait is for a kernel message or a change in the image file, bounded by
//! `linux::boot_limit()` and `linux::effect_limit()` only as hang guards.

use kumo_testkit::linux::{self, RootFs, RUN_INIT};
use kumo_testkit::TestDir;

#[test]
fn linux_mounts_its_root_from_a_kumo_disk_and_its_writes_land() {
    let test = "linux_mounts_its_root_from_a_kumo_disk_and_its_writes_land";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let _one = linux::one_at_a_time();
    let dir = TestDir::new();
    let root = RootFs::create(dir.path("").as_path(), 32);
    let mounts = root.mount_count();
    let seq0 = root.mmp_seq();
    assert!(seq0.is_some(), "mkfs made no MMP block:\n{}", root.header());
    let disk = format!("path={}", root.image.display());
    let mut vm = linux::spawn(&kernel, &linux::cmdline(linux::ROOT_ARGS), &["--disk", &disk], "linux");
    // The kernel found kumo's disk, mounted ext4 from it and read /init from it.
    linux::expect_console(&mut vm, "EXT4-fs (vda): mounted filesystem");
    linux::expect_console(&mut vm, RUN_INIT);
    // kmmpd's writes reach the image file while the kernel runs (and /init runs on).
    root.wait_mmp_writes(seq0, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{e}\n{}", linux::console_tail(&vm, 30)));
    assert_eq!(vm.child.try_wait().ok().flatten(), None, "the VM still runs:\n{}", linux::console_tail(&vm, 30));
    let console = vm.stdout();
    assert!(!console.contains("Kernel panic") && !console.contains("I/O error"), "{console}");
    linux::print_milestones(&vm);
    drop(vm);
    assert_eq!(root.mount_count(), mounts + 1, "the kernel's mount raised the mount count:\n{}", root.header());
    root.check_copy(dir.path("").as_path()).unwrap_or_else(|e| panic!("e2fsck found the image not clean:\n{e}"));
}
