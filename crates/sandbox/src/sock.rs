//! Unix sockets kumo listens on: created private, replacing only a stale socket, and the
//! credentials of whoever connects.
//!
//! Every listening unix socket of kumo (the API, `unix:` migration, the console, the
//! net-backend's vhost-user and API sockets) is made by [`bind_private`].

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Longest path a `sockaddr_un` holds (108 bytes with the NUL).
const SUN_PATH_MAX: usize = 107;

/// What is at a socket path before kumo binds it.
fn check_path(path: &Path) -> io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket; refusing to replace it", path.display()),
        )),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use (another process listens on it)", path.display()),
            )),
            // A stale socket, left by a process that died: it is replaced.
            Err(_) => Ok(true),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Binds a listening unix socket at `path` that only this user (and root) can connect to,
/// with mode 0600 from the moment it is reachable. A stale socket at `path` is replaced;
/// anything else there (a file, a directory, a link, a live socket) is refused.
///
/// The socket is bound inside a fresh 0700 directory beside `path` (same filesystem), set to
/// 0600 there, and renamed into place: nobody else can reach it before its mode is right.
/// A umask around bind(2) would do the same with less code, but the umask is the process's:
/// another thread creating a file meanwhile would get the wrong mode. The rename uses
/// `RENAME_NOREPLACE` when nothing was at `path`, so a file created there meanwhile is not
/// replaced; a stale socket is replaced by the rename itself (atomically: no moment without a
/// socket at `path`). The listener's own address (`local_addr`) is the temporary one.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    let stale = check_path(path)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmpdir = make_private_dir(parent)?;
    let r = bind_in(&tmpdir, path, stale);
    let _ = std::fs::remove_dir(&tmpdir);
    r
}

fn bind_in(tmpdir: &Path, path: &Path, stale: bool) -> io::Result<UnixListener> {
    let inner = tmpdir.join("s");
    let (listener, dirfd) = if inner.as_os_str().len() <= SUN_PATH_MAX {
        (UnixListener::bind(&inner)?, None)
    } else {
        // Too long for sockaddr_un: bind through the directory's fd instead.
        let d = std::fs::File::open(tmpdir)?;
        let short = PathBuf::from(format!("/proc/self/fd/{}/s", d.as_raw_fd()));
        (UnixListener::bind(short)?, Some(d))
    };
    drop(dirfd);
    let placed = (|| {
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        rename(&inner, path, !stale)
    })();
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&inner);
        return Err(e);
    }
    Ok(listener)
}

/// `mkdtemp(PARENT/.kumo-sock-XXXXXX)`: a new directory only this user can enter.
fn make_private_dir(parent: &Path) -> io::Result<PathBuf> {
    let mut template = parent.join(".kumo-sock-XXXXXX").into_os_string().into_vec();
    template.push(0);
    // SAFETY: mkdtemp rewrites the XXXXXX of a NUL-terminated buffer we own; checked.
    let r = unsafe { libc::mkdtemp(template.as_mut_ptr().cast()) };
    if r.is_null() {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("cannot create a private directory in {}: {e}", parent.display()),
        ));
    }
    template.pop();
    Ok(PathBuf::from(std::ffi::OsString::from_vec(template)))
}

fn rename(from: &Path, to: &Path, noreplace: bool) -> io::Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
    };
    let (f, t) = (c(from)?, c(to)?);
    let flags = if noreplace { libc::RENAME_NOREPLACE } else { 0 };
    // SAFETY: renameat2 with NUL-terminated paths relative to the working directory; checked.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), flags) };
    if r != 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::AlreadyExists {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} appeared while kumo was binding it; refusing to replace it", to.display()),
            ));
        }
        return Err(io::Error::new(e.kind(), format!("cannot place the socket at {}: {e}", to.display())));
    }
    Ok(())
}

/// A listening socket in a fresh 0700 directory of its own (under `parent`), for a connection
/// kumo makes to itself: nobody but this user and root can reach it, unlike an abstract socket,
/// which every process in the network namespace can connect to. Removed (socket and
/// directory) when dropped.
#[derive(Debug)]
pub struct PrivateSocket {
    pub listener: UnixListener,
    dir: PathBuf,
}

impl PrivateSocket {
    pub fn new(parent: &Path) -> io::Result<PrivateSocket> {
        let dir = make_private_dir(parent)?;
        match UnixListener::bind(dir.join("s")) {
            Ok(listener) => Ok(PrivateSocket { listener, dir }),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("s")
    }
}

impl Drop for PrivateSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Takes a listening unix stream socket this process inherited as descriptor `fd` (Cloud
/// Hypervisor's `--api-socket fd=N`, which libvirt binds and passes): it must be open, a unix
/// stream socket and listening, and is taken at most once per process. It is made close-on-exec
/// so no child inherits it. The caller did not bind it, so it never removes its file.
pub fn inherited_listener(fd: i32) -> io::Result<UnixListener> {
    use std::sync::Mutex;
    static TAKEN: Mutex<Vec<i32>> = Mutex::new(Vec::new());
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidInput, format!("descriptor {fd} {why}"));
    if fd < 3 {
        return Err(bad("is stdin, stdout or stderr, not a socket".into()));
    }
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if taken.contains(&fd) {
        return Err(bad("was already taken".into()));
    }
    // SAFETY: F_GETFD only reads the descriptor's flags; a closed fd gives EBADF.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad(format!("is not open: {}", io::Error::last_os_error())));
    }
    let opt = |name: libc::c_int| -> io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`; a non-socket gives ENOTSOCK.
        let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&mut v as *mut libc::c_int).cast(), &mut len) };
        if r != 0 {
            return Err(bad(format!("is not a socket: {}", io::Error::last_os_error())));
        }
        Ok(v)
    };
    if opt(libc::SO_DOMAIN)? != libc::AF_UNIX || opt(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return Err(bad("is not a unix stream socket".into()));
    }
    if opt(libc::SO_ACCEPTCONN)? != 1 {
        return Err(bad("is a unix socket that is not listening".into()));
    }
    // SAFETY: the descriptor is open, is a listening unix stream socket, and nothing in this
    // process owns it (it was inherited, and TAKEN lets it be taken only once).
    let listener = unsafe { <UnixListener as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    taken.push(fd);
    // SAFETY: F_SETFD on a descriptor this process now owns.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(listener)
}

/// Removes `path` if it is still the socket `id` ([`socket_id`]): a socket that was removed
/// or replaced by someone else meanwhile is left alone.
pub fn remove_socket(path: &Path, id: Option<(u64, u64)>) {
    if id.is_some() && socket_id(path) == id {
        let _ = std::fs::remove_file(path);
    }
}

/// The (device, inode) of the socket at `path`, if a socket is there.
pub fn socket_id(path: &Path) -> Option<(u64, u64)> {
    let m = std::fs::symlink_metadata(path).ok()?;
    m.file_type().is_socket().then(|| (m.dev(), m.ino()))
}

/// Who is at the other end of a unix connection (`SO_PEERCRED`: as of its connect).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials of the peer of `s`.
pub fn peer_cred(s: &impl AsRawFd) -> io::Result<PeerCred> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(SO_PEERCRED) writes at most `len` bytes into `c`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred { pid: c.pid, uid: c.uid, gid: c.gid })
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Parses `UID[,UID…]` (`--api-allow-uid`).
pub fn parse_uids(s: &str) -> Result<Vec<u32>, String> {
    let uids: Result<Vec<u32>, _> = s.split(',').map(|u| u.trim().parse::<u32>()).collect();
    match uids {
        Ok(v) if !v.is_empty() => Ok(v),
        _ => Err(format!("`{s}` is not a list of uids (e.g. 1000,1001)")),
    }
}

/// Checks a connection's peer against `allowed` (None: anyone who can open the 0600 socket).
/// Logs the peer at debug either way. The error says who was refused.
pub fn check_peer(s: &impl AsRawFd, allowed: Option<&[u32]>, what: &str) -> io::Result<PeerCred> {
    let p = peer_cred(s)?;
    tracing::debug!(uid = p.uid, pid = p.pid, "{what}: connection");
    match allowed {
        Some(list) if !list.contains(&p.uid) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{what}: uid {} (pid {}) is not allowed to connect", p.uid, p.pid),
        )),
        _ => Ok(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(test: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-sandbox-sock-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn an_inherited_descriptor_must_be_a_listening_unix_socket() {
        use std::os::fd::IntoRawFd;
        assert!(inherited_listener(1).unwrap_err().to_string().contains("stdin, stdout or stderr"));
        assert!(inherited_listener(987_654).unwrap_err().to_string().contains("is not open"));
        let f = std::fs::File::open("/proc/self/status").unwrap().into_raw_fd();
        assert!(inherited_listener(f).unwrap_err().to_string().contains("is not a socket"), "a file");
        let (a, _b) = UnixStream::pair().unwrap();
        let a = a.into_raw_fd();
        assert!(inherited_listener(a).unwrap_err().to_string().contains("not listening"), "a connected socket");
        let d = dir("inherit");
        let l = UnixListener::bind(d.join("s")).unwrap().into_raw_fd();
        let taken = inherited_listener(l).expect("a listening unix socket is taken");
        assert!(inherited_listener(l).unwrap_err().to_string().contains("already taken"));
        let c = UnixStream::connect(d.join("s")).unwrap();
        let (s, _) = taken.accept().unwrap();
        assert_eq!(peer_cred(&s).unwrap().pid, peer_cred(&c).unwrap().pid);
        // The file's and the pair's raw descriptors stay open until the test process ends.
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_new_socket_is_0600_and_reachable() {
        let d = dir("new");
        let p = d.join("api.sock");
        let l = bind_private(&p).unwrap();
        assert_eq!(mode(&p), 0o600);
        let c = UnixStream::connect(&p).unwrap();
        let (s, _) = l.accept().unwrap();
        let me = peer_cred(&s).unwrap();
        assert_eq!((me.uid, me.pid), (euid(), std::process::id() as i32));
        assert_eq!(peer_cred(&c).unwrap().uid, euid());
        // Only the socket is left in the directory: the private one is gone.
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["api.sock"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_or_a_file_refused() {
        let d = dir("stale");
        let p = d.join("s.sock");
        drop(UnixListener::bind(&p).unwrap()); // stale: nobody listens
        let l = bind_private(&p).unwrap();
        let e = bind_private(&p).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(e.to_string().contains("is in use"), "{e}");
        drop(l);

        let f = d.join("file");
        std::fs::write(&f, b"data").unwrap();
        let e = bind_private(&f).unwrap_err().to_string();
        assert!(e.contains("exists and is not a socket; refusing to replace it"), "{e}");
        assert_eq!(std::fs::read(&f).unwrap(), b"data");
        std::os::unix::fs::symlink(&f, d.join("link")).unwrap();
        assert!(bind_private(&d.join("link")).unwrap_err().to_string().contains("not a socket"));
        assert!(bind_private(&d.join("nodir/x.sock")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_long_path_binds_through_the_directory_fd() {
        let d = dir("long");
        // A directory path of 95 bytes: its socket fits sockaddr_un, the private one does not.
        let deep = d.join("d".repeat(94usize.saturating_sub(d.as_os_str().len()).max(1)));
        std::fs::create_dir_all(&deep).unwrap();
        let p = deep.join("k.sock");
        assert!(
            p.as_os_str().len() <= SUN_PATH_MAX && deep.join(".kumo-sock-XXXXXX/s").as_os_str().len() > SUN_PATH_MAX
        );
        let _l = bind_private(&p).unwrap();
        assert_eq!(mode(&p), 0o600);
        UnixStream::connect(&p).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_private_socket_lives_in_a_0700_directory_until_dropped() {
        let d = dir("private");
        let p = PrivateSocket::new(&d).unwrap();
        let path = p.path();
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        let _c = UnixStream::connect(&path).unwrap();
        p.listener.accept().unwrap();
        drop(p);
        assert!(!path.exists() && !path.parent().unwrap().exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn removal_and_peer_checks() {
        let d = dir("remove");
        let p = d.join("x.sock");
        let _l = bind_private(&p).unwrap();
        let id = socket_id(&p);
        remove_socket(&p, Some((0, 0)));
        assert!(p.exists(), "not ours: left alone");
        remove_socket(&p, id);
        assert!(!p.exists());
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(check_peer(&a, None, "test").is_ok());
        assert!(check_peer(&a, Some(&[euid()]), "test").is_ok());
        let e = check_peer(&a, Some(&[euid().wrapping_add(1)]), "test").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains(&format!("uid {} ", euid())), "{e}");
        assert_eq!(parse_uids("0, 1000").unwrap(), [0, 1000]);
        assert!(parse_uids("bob").is_err() && parse_uids("").is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
