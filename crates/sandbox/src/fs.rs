//! Files kumo writes or reads at paths it was given (snapshots), without following links.
//!
//! A path from the API acts wherever kumo's user can write, so a file is never created at a
//! name someone else could have prepared: [`Staged`] writes a new, uniquely named file beside
//! the target (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600) and renames it over the target only if
//! the target is not a symbolic link; [`open_nofollow`] reads a file that is not a link.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A new file beside `target`, renamed over it by [`Staged::commit`] or removed when dropped.
#[derive(Debug)]
pub struct Staged {
    dir: OwnedFd,
    tmp: CString,
    name: CString,
    target: PathBuf,
    committed: bool,
}

/// `path` as a C string (a path with a NUL byte cannot name a file).
fn cstr(p: &OsStr) -> io::Result<CString> {
    CString::new(p.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// The error for a path that is a symbolic link where kumo will not follow or replace one.
pub fn symlink_refused(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is a symbolic link: kumo does not write through or replace links", path.display()),
    )
}

/// Fails if `path` is a symbolic link (a missing path is fine).
pub fn refuse_symlink(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(symlink_refused(path)),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Opens the directory `dir` (for the `*at` calls below).
fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    let c = cstr(dir.as_os_str())?;
    // SAFETY: open with a NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Creates `name` in `dir` as a new file: never an existing one, never through a link
/// (`O_EXCL` fails on any existing name, a dangling link included), mode 0600.
pub fn create_new_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<File> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat with a directory fd we hold and a NUL-terminated name; checked.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// 64 random bits (getrandom), for names nobody can guess in advance.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Never seen for 8 bytes; the name stays unique through O_EXCL anyway.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32;
    }
    u64::from_ne_bytes(b)
}

impl Staged {
    /// A new file in `target`'s directory, named `.NAME.RANDOM.tmp`. `target` must not be a
    /// symbolic link (checked again at [`Staged::commit`]).
    pub fn create(target: &Path) -> io::Result<(Staged, File)> {
        refuse_symlink(target)?;
        let base = target.file_name().ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no file", target.display()))
        })?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = open_dir(parent)?;
        let name = cstr(base)?;
        for _ in 0..16 {
            let mut tmp = b".".to_vec();
            tmp.extend_from_slice(base.as_bytes());
            tmp.extend_from_slice(format!(".{:016x}.tmp", random_u64()).as_bytes());
            let tmp = cstr(OsStr::from_bytes(&tmp))?;
            match create_new_at(&dir, &tmp) {
                Ok(f) => {
                    let staged = Staged { dir, tmp, name, target: target.to_path_buf(), committed: false };
                    return Ok((staged, f));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(io::ErrorKind::AlreadyExists, "no free temporary name after 16 tries"))
    }

    /// Where the file is until it is committed.
    pub fn tmp_path(&self) -> PathBuf {
        self.target.with_file_name(OsStr::from_bytes(self.tmp.as_bytes()))
    }

    /// Renames the file over the target and syncs the directory. Refuses if the target is now
    /// a symbolic link (looked at through the directory fd, `AT_SYMLINK_NOFOLLOW`).
    ///
    /// Why a check and `renameat` rather than `renameat2`: `RENAME_NOREPLACE` would refuse to
    /// replace an earlier snapshot too, and `RENAME_EXCHANGE` would briefly leave the old file
    /// under the temporary name. A link planted between the check and the rename is replaced,
    /// never followed: rename(2) acts on the name itself, so the link's target is never written.
    pub fn commit(mut self) -> io::Result<()> {
        // SAFETY: a zeroed stat is a valid output buffer for fstatat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstatat with our directory fd, a NUL-terminated name and a stat buffer.
        let r = unsafe { libc::fstatat(self.dir.as_raw_fd(), self.name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
        if r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(symlink_refused(&self.target));
        }
        let d = self.dir.as_raw_fd();
        // SAFETY: renameat within one directory fd we hold, NUL-terminated names.
        if unsafe { libc::renameat(d, self.tmp.as_ptr(), d, self.name.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        self.committed = true;
        // The rename is durable once the directory is synced.
        // SAFETY: fsync on the directory fd we hold.
        if unsafe { libc::fsync(d) } != 0 {
            tracing::warn!("cannot sync the directory of {}: {}", self.target.display(), io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            // SAFETY: unlinkat of our own temporary name in the directory fd we hold.
            unsafe { libc::unlinkat(self.dir.as_raw_fd(), self.tmp.as_ptr(), 0) };
        }
    }
}

/// Opens `path` for reading, refusing a symbolic link (`O_NOFOLLOW`) with a clear error.
pub fn open_nofollow(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            symlink_refused(path)
        } else {
            e
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn dir(test: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-sandbox-fs-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_staged_file_is_private_and_replaces_a_regular_file() {
        let d = dir("staged");
        let target = d.join("vm.snap");
        std::fs::write(&target, b"old").unwrap();
        let (s, mut f) = Staged::create(&target).unwrap();
        let tmp = s.tmp_path();
        assert!(tmp.file_name().unwrap().to_str().unwrap().starts_with(".vm.snap."), "{tmp:?}");
        assert_eq!(std::fs::metadata(&tmp).unwrap().permissions().mode() & 0o777, 0o600);
        f.write_all(b"new").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert!(!tmp.exists());
        // Dropped uncommitted: nothing is left behind.
        let (s, _) = Staged::create(&target).unwrap();
        let tmp = s.tmp_path();
        drop(s);
        assert!(!tmp.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_planted_symlink_is_never_followed() {
        let d = dir("planted");
        let victim = d.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        // At a name kumo creates: O_EXCL refuses it, and the link's target is untouched.
        std::os::unix::fs::symlink(&victim, d.join("x.tmp")).unwrap();
        let dfd = open_dir(&d).unwrap();
        let e = create_new_at(&dfd, c"x.tmp").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        // At the target: refused at creation, and at commit if planted after it.
        let target = d.join("vm.snap");
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        let e = Staged::create(&target).unwrap_err().to_string();
        assert!(e.contains("vm.snap is a symbolic link"), "{e}");
        std::fs::remove_file(&target).unwrap();
        let (s, mut f) = Staged::create(&target).unwrap();
        f.write_all(b"snapshot").unwrap();
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        let tmp = s.tmp_path();
        assert!(s.commit().unwrap_err().to_string().contains("symbolic link"));
        assert!(!tmp.exists(), "the refused file is removed");
        assert!(std::fs::symlink_metadata(&target).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // Reading refuses a link too.
        let e = open_nofollow(&target).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::io::read_to_string(open_nofollow(&victim).unwrap()).unwrap(), "precious");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
