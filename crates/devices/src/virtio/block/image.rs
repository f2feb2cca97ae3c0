//! A raw disk image file: opened without following links, checked (size, format) and locked
//! against other writers with an OFD lock, shared for a read-only disk and exclusive for a
//! read-write one, as QEMU's image locking does. The lock is given back on drop, or explicitly
//! with [`DiskImage::unlock`] (a migration's source hands the image to its destination) and
//! taken again with [`DiskImage::relock`].

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::SECTOR_SIZE;

/// Why an image cannot be used: each a one-line message naming the path.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("disk image {0}: no such file")]
    Missing(PathBuf),
    #[error("disk image {0}: permission denied (not {1})")]
    Permission(PathBuf, &'static str),
    #[error("disk image {0}: is a directory")]
    Directory(PathBuf),
    #[error("disk image {0}: is a symbolic link, which kumo does not follow")]
    Symlink(PathBuf),
    #[error("disk image {0}: not a regular file")]
    NotRegular(PathBuf),
    #[error("disk image {0}: is empty (zero length)")]
    Empty(PathBuf),
    #[error("disk image {0}: its size {1} is not a multiple of 512 bytes")]
    Unaligned(PathBuf, u64),
    #[error("disk image {0}: is a {1} image; only raw images are supported (convert it: qemu-img convert -O raw)")]
    Format(PathBuf, &'static str),
    #[error("disk image {0}: direct=on, but its file system does not support O_DIRECT")]
    NoDirect(PathBuf),
    #[error("disk image {0} is in use by another process (locked for {1})")]
    Locked(PathBuf, &'static str),
    #[error("disk image {0}: {1}")]
    Io(PathBuf, String),
}

/// An open raw image.
#[derive(Debug)]
pub struct DiskImage {
    path: PathBuf,
    file: Arc<File>,
    size: u64,
    readonly: bool,
    direct: bool,
    locked: bool,
}

/// A buffer aligned for O_DIRECT reads of the image's first block.
#[repr(C, align(4096))]
struct Block4k([u8; 4096]);

/// Formats recognised by their first bytes: (offset, magic, name).
const MAGICS: &[(usize, &[u8], &str)] = &[
    (0, b"QFI\xfb", "qcow2"),
    (0, b"QED\0", "QED"),
    (0, b"KDMV", "VMDK"),
    (0, b"# Disk DescriptorFile", "VMDK descriptor"),
    (0, b"vhdxfile", "VHDX"),
    (0, b"conectix", "VHD"),
    (0x40, b"\x7f\x10\xda\xbe", "VDI"),
];

/// The non-raw format whose magic `head` starts with, if any.
pub fn detect_format(head: &[u8]) -> Option<&'static str> {
    MAGICS.iter().find(|(off, magic, _)| head.get(*off..off + magic.len()) == Some(magic)).map(|&(_, _, name)| name)
}

impl DiskImage {
    /// Opens `path` (read-only or read-write, O_DIRECT if `direct`), checks it and locks it.
    pub fn open(path: &Path, readonly: bool, direct: bool) -> Result<DiskImage, ImageError> {
        let mut img = Self::open_unlocked(path, readonly, direct)?;
        img.relock()?;
        Ok(img)
    }

    /// [`DiskImage::open`] without the lock, which [`DiskImage::relock`] takes later: a
    /// migration's destination opens and checks the image while its source still holds it.
    pub fn open_unlocked(path: &Path, readonly: bool, direct: bool) -> Result<DiskImage, ImageError> {
        let p = || path.to_path_buf();
        let mut flags = libc::O_NOFOLLOW | libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        let file = std::fs::OpenOptions::new().read(true).write(!readonly).custom_flags(flags).open(path).map_err(
            |e| match (e.kind(), e.raw_os_error()) {
                (io::ErrorKind::NotFound, _) => ImageError::Missing(p()),
                (io::ErrorKind::PermissionDenied, _) => {
                    ImageError::Permission(p(), if readonly { "readable" } else { "readable and writable" })
                }
                (_, Some(libc::EISDIR)) => ImageError::Directory(p()),
                (_, Some(libc::ELOOP)) => ImageError::Symlink(p()),
                (_, Some(libc::EINVAL)) if direct => ImageError::NoDirect(p()),
                _ => ImageError::Io(p(), e.to_string()),
            },
        )?;
        let meta = file.metadata().map_err(|e| ImageError::Io(p(), e.to_string()))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            return Err(ImageError::Directory(p()));
        }
        if !ft.is_file() || ft.is_block_device() {
            return Err(ImageError::NotRegular(p()));
        }
        let size = meta.len();
        if size == 0 {
            return Err(ImageError::Empty(p()));
        }
        if size % SECTOR_SIZE != 0 {
            return Err(ImageError::Unaligned(p(), size));
        }
        let mut head = Box::new(Block4k([0; 4096]));
        let want = size.min(4096) as usize;
        let n = match file.read_at(&mut head.0[..want], 0) {
            Ok(n) => n,
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => return Err(ImageError::NoDirect(p())),
            Err(e) => return Err(ImageError::Io(p(), format!("reading its first block: {e}"))),
        };
        if let Some(fmt) = detect_format(&head.0[..n]) {
            return Err(ImageError::Format(p(), fmt));
        }
        Ok(DiskImage { path: p(), file: Arc::new(file), size, readonly, direct, locked: false })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The size in bytes (a multiple of 512).
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn readonly(&self) -> bool {
        self.readonly
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn locked(&self) -> bool {
        self.locked
    }

    /// The open file, which the I/O backends share.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Takes the image's lock (again): shared for read-only, exclusive for read-write.
    pub fn relock(&mut self) -> Result<(), ImageError> {
        let kind = if self.readonly { libc::F_RDLCK } else { libc::F_WRLCK };
        match self.ofd_lock(kind as i16) {
            Ok(()) => {
                self.locked = true;
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                // Whoever holds it: a reader blocks only writers.
                let held = self.holder().unwrap_or(libc::F_WRLCK as i16);
                let what = if held == libc::F_RDLCK as i16 { "reading" } else { "writing" };
                Err(ImageError::Locked(self.path.clone(), what))
            }
            Err(e) => Err(ImageError::Io(self.path.clone(), format!("locking it: {e}"))),
        }
    }

    /// Gives the lock back (the file stays open).
    pub fn unlock(&mut self) -> Result<(), ImageError> {
        if self.locked {
            self.ofd_lock(libc::F_UNLCK as i16)
                .map_err(|e| ImageError::Io(self.path.clone(), format!("unlocking it: {e}")))?;
            self.locked = false;
        }
        Ok(())
    }

    fn flock(kind: i16) -> libc::flock {
        // SAFETY: flock is plain old data; all-zero is a valid value (whole file from offset 0).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as i16;
        fl
    }

    fn ofd_lock(&self, kind: i16) -> io::Result<()> {
        let fl = Self::flock(kind);
        // SAFETY: F_OFD_SETLK on our own fd with a valid flock that outlives the call.
        let r = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The kind of lock that blocks ours, if one does.
    fn holder(&self) -> Option<i16> {
        let mut fl = Self::flock(if self.readonly { libc::F_RDLCK } else { libc::F_WRLCK } as i16);
        // SAFETY: F_OFD_GETLK on our own fd with a valid flock it fills in.
        let r = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
        (r == 0 && fl.l_type != libc::F_UNLCK as i16).then_some(fl.l_type)
    }
}

impl Drop for DiskImage {
    fn drop(&mut self) {
        // The backends may hold the file a little longer; the lock goes now.
        let _ = self.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn dir(test: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-blk-img-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn bad_images_are_refused_in_one_line() {
        let d = dir("refusals");
        let open = |p: &Path| DiskImage::open(p, false, false).unwrap_err().to_string();
        let missing = d.join("missing.img");
        assert_eq!(open(&missing), format!("disk image {}: no such file", missing.display()));
        assert_eq!(open(&d), format!("disk image {}: is a directory", d.display()));
        let e = DiskImage::open(&d, true, false).unwrap_err().to_string();
        assert_eq!(e, format!("disk image {}: is a directory", d.display()));
        let empty = d.join("empty.img");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(open(&empty), format!("disk image {}: is empty (zero length)", empty.display()));
        let odd = d.join("odd.img");
        std::fs::write(&odd, vec![0u8; 1000]).unwrap();
        assert_eq!(open(&odd), format!("disk image {}: its size 1000 is not a multiple of 512 bytes", odd.display()));
        let qcow = d.join("q.qcow2");
        let mut q = vec![0u8; 4096];
        q[..4].copy_from_slice(b"QFI\xfb");
        std::fs::write(&qcow, &q).unwrap();
        let e = open(&qcow);
        assert!(e.starts_with(&format!("disk image {}: is a qcow2 image; only raw", qcow.display())), "{e}");
        let vdi = d.join("v.vdi");
        let mut v = vec![0u8; 4096];
        v[0x40..0x44].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        std::fs::write(&vdi, &v).unwrap();
        assert!(open(&vdi).contains("is a VDI image"));
        let link = d.join("link.img");
        std::os::unix::fs::symlink(&odd, &link).unwrap();
        assert!(open(&link).contains("is a symbolic link"), "{}", open(&link));
        for e in [open(&missing), open(&qcow), open(&empty)] {
            assert!(!e.contains('\n'));
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn unreadable_images_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir("perm");
        let f = d.join("noperm.img");
        std::fs::write(&f, vec![0u8; 4096]).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o000)).unwrap();
        // root reads anything: only check where permissions bite.
        if std::fs::read(&f).is_err() {
            let e = DiskImage::open(&f, true, false).unwrap_err().to_string();
            assert_eq!(e, format!("disk image {}: permission denied (not readable)", f.display()));
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn writers_exclude_each_other_and_readers_share() {
        let d = dir("locks");
        let f = d.join("disk.img");
        std::fs::write(&f, vec![0u8; 8192]).unwrap();
        let mut a = DiskImage::open(&f, false, false).unwrap();
        assert!(a.locked());
        let e = DiskImage::open(&f, false, false).unwrap_err().to_string();
        assert_eq!(e, format!("disk image {} is in use by another process (locked for writing)", f.display()));
        let e = DiskImage::open(&f, true, false).unwrap_err().to_string();
        assert!(e.ends_with("(locked for writing)"), "{e}");
        // Handed over: the lock goes, another opener gets it, and it cannot be taken back.
        a.unlock().unwrap();
        let b = DiskImage::open(&f, false, false).unwrap();
        assert!(a.relock().is_err());
        drop(b);
        a.relock().unwrap();
        drop(a);
        let r1 = DiskImage::open(&f, true, false).unwrap();
        let r2 = DiskImage::open(&f, true, false).unwrap();
        let e = DiskImage::open(&f, false, false).unwrap_err().to_string();
        assert_eq!(e, format!("disk image {} is in use by another process (locked for reading)", f.display()));
        drop((r1, r2));
        DiskImage::open(&f, false, false).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn direct_io_opens_where_the_file_system_has_it() {
        let d = dir("direct");
        let f = d.join("disk.img");
        std::fs::write(&f, vec![7u8; 8192]).unwrap();
        match DiskImage::open(&f, true, true) {
            Ok(img) => assert!(img.direct() && img.size() == 8192),
            Err(e) => assert_eq!(e, ImageError::NoDirect(f.clone())),
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
