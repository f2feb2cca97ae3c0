//! A virtio-blk request read from its descriptor chain and checked (virtio 1.2, 5.2.6): the
//! 16-byte header in device-readable buffers, then the data, then one device-writable status
//! byte at the very end. Framing is free (VERSION_1 implies ANY_LAYOUT): the header may span
//! descriptors and share one with data. What cannot be served gets a status, or, when the chain
//! has no place for a status byte, is [`Bad::Broken`].

use virtio_bindings::virtio_blk as vb;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::backend::IoVecs;
use super::{GuestMemory, SECTOR_SIZE};

pub const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
pub const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
pub const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// The bytes of `struct virtio_blk_outhdr`.
pub const HEADER_LEN: usize = 16;
/// The bytes of `struct virtio_blk_discard_write_zeroes`.
pub const SEGMENT_LEN: usize = 16;
/// GET_ID's answer.
pub const ID_BYTES: usize = vb::VIRTIO_BLK_ID_BYTES as usize;

/// What the device checks requests against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The disk's size in sectors.
    pub capacity: u64,
    /// Data descriptors per request.
    pub seg_max: u32,
    /// Bytes per data descriptor.
    pub size_max: u32,
    /// Sectors per discard / write-zeroes segment.
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub readonly: bool,
    /// The features the driver accepted.
    pub features: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes { unmap: bool },
}

/// A request ready to run.
#[derive(Debug, Clone)]
pub struct Request {
    pub kind: Kind,
    /// IN/OUT: the first sector.
    pub sector: u64,
    /// The data buffers: guest-writable for IN and GET_ID, guest-readable for OUT.
    pub data: Vec<(GuestAddress, u32)>,
    /// Their total length.
    pub len: u64,
    /// DISCARD / WRITE_ZEROES: the byte range (none for zero sectors).
    pub range: Option<(u64, u64)>,
    pub status: GuestAddress,
}

/// A request that will not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// No status byte can be given back: the queue is misprogrammed.
    Broken(&'static str),
    /// Answered with `code` at `status`.
    Status { status: GuestAddress, code: u8, why: &'static str },
}

impl Bad {
    pub fn why(&self) -> &'static str {
        match self {
            Bad::Broken(w) | Bad::Status { why: w, .. } => w,
        }
    }
}

/// Buffers `(address, length)`, zero-length ones left out.
type Pieces = Vec<(GuestAddress, u32)>;

/// Splits `pieces` after `n` bytes: (the first `n` bytes, the rest).
fn split_at(pieces: &[(GuestAddress, u32)], n: usize) -> Option<(Pieces, Pieces)> {
    let (mut head, mut rest, mut need) = (Vec::new(), Vec::new(), n);
    for &(a, l) in pieces {
        if need == 0 {
            rest.push((a, l));
        } else if (l as usize) <= need {
            head.push((a, l));
            need -= l as usize;
        } else {
            head.push((a, need as u32));
            rest.push((a.checked_add(need as u64)?, l - need as u32));
            need = 0;
        }
    }
    (need == 0).then_some((head, rest))
}

/// Reads `pieces` whole into `buf` (which is as long as they are).
fn gather(mem: &GuestMemory, pieces: &[(GuestAddress, u32)], buf: &mut [u8]) -> bool {
    let mut off = 0;
    for &(a, l) in pieces {
        let l = l as usize;
        if mem.read_slice(&mut buf[off..off + l], a).is_err() {
            return false;
        }
        off += l;
    }
    true
}

/// Host iovecs for guest buffers `pieces` (split where they cross memory regions); `None` if
/// any byte is outside guest memory.
pub fn iovecs(mem: &GuestMemory, pieces: &[(GuestAddress, u32)]) -> Option<IoVecs> {
    let mut v = Vec::with_capacity(pieces.len());
    for &(a, l) in pieces {
        for s in GuestMemoryBackend::get_slices(mem, a, l as usize) {
            let s = s.ok()?;
            v.push(libc::iovec { iov_base: s.ptr_guard_mut().as_ptr() as *mut libc::c_void, iov_len: s.len() });
        }
    }
    Some(IoVecs(v))
}

/// Marks the guest pages of `pieces` dirty (the device wrote them behind the memory's back,
/// through iovecs): a live migration sends them again.
pub fn mark_dirty(mem: &GuestMemory, pieces: &[(GuestAddress, u32)]) {
    use vm_memory::bitmap::Bitmap as _;
    for &(a, l) in pieces {
        for s in GuestMemoryBackend::get_slices(mem, a, l as usize).flatten() {
            s.bitmap().mark_dirty(0, s.len());
        }
    }
}

/// `sector`..+`len` bytes within a disk of `capacity` sectors, without overflow.
fn in_disk(sector: u64, len: u64, capacity: u64) -> bool {
    sector.checked_mul(SECTOR_SIZE).and_then(|o| o.checked_add(len)).is_some_and(|end| end <= capacity * SECTOR_SIZE)
}

fn has(features: u64, bit: u32) -> bool {
    features & (1 << bit) != 0
}

/// Reads and checks the request in chain `descs` (in chain order; a chain that stopped early,
/// its last descriptor still pointing on, is broken).
pub fn parse(descs: &[Descriptor], mem: &GuestMemory, lim: &Limits) -> Result<Request, Bad> {
    let last = descs.last().ok_or(Bad::Broken("an empty chain"))?;
    if last.has_next() {
        return Err(Bad::Broken("the chain breaks off (a bad next index, a loop, or a bad indirect table)"));
    }
    if !last.is_write_only() || last.len() == 0 {
        return Err(Bad::Broken("no device-writable status byte at the chain's end"));
    }
    let status = last
        .addr()
        .checked_add(last.len() as u64 - 1)
        .filter(|&a| mem.address_in_range(a))
        .ok_or(Bad::Broken("the status byte is outside guest memory"))?;
    let bad = |code, why| Bad::Status { status, code, why };
    let first_w = descs.iter().position(|d| d.is_write_only()).unwrap_or(descs.len() - 1);
    if descs[first_w..].iter().any(|d| !d.is_write_only()) {
        return Err(bad(S_IOERR, "a device-readable descriptor after a device-writable one"));
    }
    let piece = |d: &Descriptor| (d.addr(), d.len());
    let readable: Pieces = descs[..first_w].iter().map(piece).filter(|p| p.1 > 0).collect();
    let mut writable: Pieces = descs[first_w..].iter().map(piece).collect();
    if let Some(w) = writable.last_mut() {
        w.1 -= 1;
    }
    writable.retain(|p| p.1 > 0);
    let (hdr_pieces, out) = split_at(&readable, HEADER_LEN).ok_or(bad(S_IOERR, "a header shorter than 16 bytes"))?;
    let mut hdr = [0u8; HEADER_LEN];
    if !gather(mem, &hdr_pieces, &mut hdr) {
        return Err(bad(S_IOERR, "the header is outside guest memory"));
    }
    let ty = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
    let total = |p: &Pieces| p.iter().map(|x| x.1 as u64).sum::<u64>();
    let mut req = Request { kind: Kind::Flush, sector, data: Vec::new(), len: 0, range: None, status };
    match ty {
        vb::VIRTIO_BLK_T_IN | vb::VIRTIO_BLK_T_OUT => {
            let write = ty == vb::VIRTIO_BLK_T_OUT;
            let (data, wrong) = if write { (out, writable) } else { (writable, out) };
            if !wrong.is_empty() {
                return Err(bad(S_IOERR, "data buffers in the wrong direction"));
            }
            if write && lim.readonly {
                return Err(bad(S_IOERR, "a write to a read-only disk"));
            }
            if data.len() > lim.seg_max as usize {
                return Err(bad(S_IOERR, "more data descriptors than seg_max"));
            }
            if data.iter().any(|p| p.1 > lim.size_max) {
                return Err(bad(S_IOERR, "a data descriptor larger than size_max"));
            }
            let len = total(&data);
            if len % SECTOR_SIZE != 0 {
                return Err(bad(S_IOERR, "a data length that is not a multiple of 512"));
            }
            if !in_disk(sector, len, lim.capacity) {
                return Err(bad(S_IOERR, "sectors past the end of the disk"));
            }
            req.kind = if write { Kind::Out } else { Kind::In };
            req.len = len;
            req.data = data;
        }
        vb::VIRTIO_BLK_T_FLUSH => {
            if !has(lim.features, vb::VIRTIO_BLK_F_FLUSH) {
                return Err(bad(S_UNSUPP, "FLUSH without the FLUSH feature"));
            }
        }
        vb::VIRTIO_BLK_T_GET_ID => {
            if !out.is_empty() {
                return Err(bad(S_IOERR, "data buffers in the wrong direction"));
            }
            req.kind = Kind::GetId;
            req.len = total(&writable).min(ID_BYTES as u64);
            req.data = split_at(&writable, req.len as usize).map(|s| s.0).unwrap_or_default();
        }
        vb::VIRTIO_BLK_T_DISCARD | vb::VIRTIO_BLK_T_WRITE_ZEROES => {
            let discard = ty == vb::VIRTIO_BLK_T_DISCARD;
            let feature = if discard { vb::VIRTIO_BLK_F_DISCARD } else { vb::VIRTIO_BLK_F_WRITE_ZEROES };
            if !has(lim.features, feature) {
                return Err(bad(S_UNSUPP, "DISCARD or WRITE_ZEROES without its feature"));
            }
            req.kind = segment(&out, &writable, mem, lim, discard, &mut req.range).map_err(|(c, w)| bad(c, w))?;
        }
        _ => return Err(bad(S_UNSUPP, "an unsupported request type")),
    }
    Ok(req)
}

/// Checks DISCARD / WRITE_ZEROES's one segment (max_discard_seg and max_write_zeroes_seg are
/// 1) and sets `range`; answers the request's kind.
fn segment(
    out: &Pieces,
    writable: &Pieces,
    mem: &GuestMemory,
    lim: &Limits,
    discard: bool,
    range: &mut Option<(u64, u64)>,
) -> Result<Kind, (u8, &'static str)> {
    if !writable.is_empty() {
        return Err((S_IOERR, "data buffers in the wrong direction"));
    }
    if lim.readonly {
        return Err((S_IOERR, "a discard or write-zeroes on a read-only disk"));
    }
    let len: u64 = out.iter().map(|x| x.1 as u64).sum();
    if len != SEGMENT_LEN as u64 {
        return Err((S_IOERR, "not exactly one 16-byte discard / write-zeroes segment"));
    }
    let mut seg = [0u8; SEGMENT_LEN];
    if !gather(mem, out, &mut seg) {
        return Err((S_IOERR, "the segment is outside guest memory"));
    }
    let sector = u64::from_le_bytes(seg[..8].try_into().unwrap_or([0; 8]));
    let sectors = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
    let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
    let unmap_flag = vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
    if flags & !unmap_flag != 0 || (discard && flags & unmap_flag != 0) {
        return Err((S_UNSUPP, "unknown segment flags"));
    }
    let max = if discard { lim.max_discard_sectors } else { lim.max_write_zeroes_sectors };
    if sectors > max {
        return Err((S_IOERR, "a segment larger than the device's limit"));
    }
    let bytes = sectors as u64 * SECTOR_SIZE;
    if !in_disk(sector, bytes, lim.capacity) {
        return Err((S_IOERR, "sectors past the end of the disk"));
    }
    *range = (sectors > 0).then_some((sector * SECTOR_SIZE, bytes));
    Ok(if discard { Kind::Discard } else { Kind::WriteZeroes { unmap: flags & unmap_flag != 0 } })
}
