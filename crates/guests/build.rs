//! Builds kumo's freestanding guest programs (guests/ at the repository root) with the host gcc
//! and embeds them. Fails the build if a guest contains an instruction this project's nested KVM
//! cannot emulate in ring 0 (see shared/NESTED-KVM.md), so a bad guest never reaches a VM.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const GUESTS: &[&str] = &[
    "hello",
    "memtouch",
    "smp",
    "netecho",
    "udpping",
    "udpsink",
    "udpsend",
    "numa",
    "sync",
    "numabench",
    "worker",
    "blkbench",
];
/// Guests also built as hosted Linux programs (with `-D<NAME>_HOSTED`, e.g. NUMABENCH_HOSTED),
/// the bare-metal side of a benchmark: the same C source and code-generation flags.
const HOSTED: &[&str] = &["numabench"];
const HOSTED_CFLAGS: &[&str] = &[
    "-O2",
    "-std=gnu11",
    "-fno-pic",
    "-no-pie",
    "-mno-red-zone",
    "-mgeneral-regs-only",
    "-mno-popcnt",
    "-fcf-protection=none",
    "-fno-tree-vectorize",
    "-pthread",
    "-Wall",
    "-Werror",
];
/// Guests linked with the network driver and stack (guests/src/net/).
const NET_GUESTS: &[&str] = &["netecho", "udpping", "udpsink", "udpsend"];
const NET_SOURCES: &[&str] = &["net/boot.c", "net/pci.c", "net/virtio.c", "net/stack.c"];
/// Guests linked with the virtio-blk driver (guests/src/blk/).
const BLK_GUESTS: &[&str] = &["blkbench"];
const BLK_SOURCES: &[&str] = &["blk/blk.c"];
const CFLAGS: &[&str] = &[
    "-m64",
    "-O2",
    "-std=gnu11",
    "-ffreestanding",
    "-fno-pic",
    "-no-pie",
    "-nostdlib",
    "-static",
    "-mno-red-zone",
    "-mgeneral-regs-only",
    "-mno-popcnt",
    "-fno-stack-protector",
    "-fno-builtin",
    "-fcf-protection=none",
    "-fno-asynchronous-unwind-tables",
    "-fno-tree-vectorize",
    "-Wall",
    "-Werror",
    "-Wl,--build-id=none",
    "-Wl,-z,noexecstack",
    "-Wl,--no-warn-rwx-segments",
];
/// Mnemonics that stop a vCPU with an emulation failure here, or use state kumo masks.
const FORBIDDEN: &[&str] = &[
    "int3",
    "clac",
    "stac",
    "xrstor",
    "xsave",
    "rdtscp",
    "popcnt",
    "fwait",
    "ldmxcsr",
    "stmxcsr",
    "cmpxchg16b",
    "%xmm",
    "%ymm",
    "%zmm",
];

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let src = manifest_dir.join("../../guests").canonicalize().expect("guests/ source directory");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cc = env::var("KUMO_GUEST_CC").unwrap_or_else(|_| "gcc".into());
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-env-changed=KUMO_GUEST_CC");

    let runtime = [
        src.join("runtime/start.S"),
        src.join("runtime/runtime.c"),
        src.join("runtime/pvh.S"),
        src.join("runtime/pvh.c"),
    ];
    let mut table = String::from("pub static BUILT: &[(&str, &[u8])] = &[\n");
    for name in GUESTS {
        let elf = out.join(format!("{name}.elf"));
        let status = Command::new(&cc)
            .args(CFLAGS)
            .arg("-I")
            .arg(src.join("include"))
            .arg("-T")
            .arg(src.join("runtime/kumo.ld"))
            .arg("-o")
            .arg(&elf)
            .args(&runtime)
            .arg(src.join(format!("src/{name}.c")))
            .args(NET_SOURCES.iter().filter(|_| NET_GUESTS.contains(name)).map(|f| src.join("src").join(f)))
            .args(BLK_SOURCES.iter().filter(|_| BLK_GUESTS.contains(name)).map(|f| src.join("src").join(f)))
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cc} to build guest {name}: {e}"));
        assert!(status.success(), "building guest {name} with {cc} failed");
        check_instructions(name, &elf);
        table.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", elf.display().to_string()));
    }
    table.push_str("];\n");
    table.push_str("pub static HOST_PROGRAMS: &[(&str, &str)] = &[\n");
    for name in HOSTED {
        let exe = out.join(format!("{name}-host"));
        let status = Command::new(&cc)
            .args(HOSTED_CFLAGS)
            .arg(format!("-D{}_HOSTED", name.to_uppercase()))
            .arg("-o")
            .arg(&exe)
            .arg(src.join(format!("src/{name}.c")))
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cc} to build host program {name}: {e}"));
        assert!(status.success(), "building host program {name} with {cc} failed");
        table.push_str(&format!("    ({name:?}, {:?}),\n", exe.display().to_string()));
    }
    table.push_str("];\n");
    fs::write(out.join("built.rs"), table).unwrap();
}

fn check_instructions(name: &str, elf: &Path) {
    let dis = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(elf)
        .output()
        .unwrap_or_else(|e| panic!("cannot run objdump to check guest {name}: {e}"));
    assert!(dis.status.success(), "objdump failed on guest {name}");
    let text = String::from_utf8_lossy(&dis.stdout);
    for line in text.lines() {
        let insn = line.split('\t').nth(1).unwrap_or("");
        if let Some(bad) = FORBIDDEN
            .iter()
            .find(|f| insn.split_whitespace().next() == Some(**f) || (f.starts_with('%') && insn.contains(**f)))
        {
            panic!("guest {name} contains `{bad}`, which nested KVM cannot run in ring 0: {line}");
        }
    }
}
