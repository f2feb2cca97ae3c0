//! The versioned migration stream. The byte layout is specified in docs/migration-format.md;
//! this module is its reference implementation.
//!
//! A stream is a header ([`write_header`]/[`read_header`]) followed by framed records
//! (`tag, flags, reserved, len, seq`, body, CRC-32 trailer). The sender produces records with
//! an [`Encoder`] (bytes into a caller's buffer, or a [`BatchFrame`] for page data it sends
//! itself from guest memory) or a [`Writer`] (an encoder around a [`Write`]). The receiver
//! reads them with a [`Reader`], which checks framing, checksums, sequence numbers, page
//! ranges and the record grammar, and hands out records borrowed from a reused buffer. The
//! receiver answers on the same connection with [`Reply`] frames, read by a [`ReplyReader`].

use std::fmt;
use std::io::{self, Read, Write};

/// First 8 bytes of every stream.
pub const MAGIC: [u8; 8] = *b"KUMOMIG\0";
/// The stream version this code writes and the only one it reads. Version 6: zero pages travel
/// as runs of page frames (`ZeroPages`) instead of 4 KiB of zeros each. docs/migration-format.md
/// has the history.
pub const VERSION: u32 = 6;
/// Guest page size; the only one this version allows.
pub const PAGE_SIZE: u32 = 4096;
const PAGE: usize = PAGE_SIZE as usize;
/// Most pages in one `MemBatch` (Xen's 1,024-page batch).
pub const MAX_BATCH_PAGES: usize = 1024;
/// Largest description JSON in the header.
pub const MAX_DESC_LEN: usize = 1 << 20;
/// Largest `State` body.
pub const MAX_STATE_LEN: usize = 64 << 20;
/// Largest `Abort`/`Failed` reason; longer reasons are cut at a character boundary.
pub const MAX_REASON_LEN: usize = 64 << 10;
/// `MemBatch` flag: the CRC does not cover the page data (zero-copy sends from live memory).
pub const FLAG_DATA_UNCHECKED: u8 = 0x1;
/// `MemBatch` flag: the receiver answers with `Placed` once the batch is in guest memory (the
/// paper's per-batch completion notice; the serial engine waits for it). First connection only.
pub const FLAG_ACK: u8 = 0x2;
/// Size of the frame header before every record body.
pub const FRAME_HEADER_LEN: usize = 16;
/// Size of the CRC-32 trailer after every record body.
pub const TRAILER_LEN: usize = 4;
/// Size of the stream header before the description JSON (magic, version, desc_len).
pub const HEADER_FIXED_LEN: usize = 16;
/// Most runs in one `ZeroPages` record.
pub const MAX_ZERO_RUNS: usize = 1024;
/// Largest `ZeroPages` body: round, count and [`MAX_ZERO_RUNS`] runs of (gfn, pages).
pub const MAX_ZERO_BODY: usize = 8 + MAX_ZERO_RUNS * 16;
/// Largest `MemBatch` body: `batch_body_len(MAX_BATCH_PAGES)`.
pub const MAX_BATCH_BODY: usize = 8 + MAX_BATCH_PAGES * (8 + PAGE);

/// Body length of a `MemBatch` of `count` pages: round, count, gfns, page data.
pub const fn batch_body_len(count: usize) -> usize {
    8 + count * (8 + PAGE)
}

/// Length of the part of a `MemBatch` body that precedes the page data (round, count, gfns).
pub const fn batch_meta_len(count: usize) -> usize {
    8 + count * 8
}

/// Errors reading or writing a migration stream. Reading never panics, whatever the input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The stream does not start with [`MAGIC`].
    #[error("not a kumo migration stream (magic {found:02x?})")]
    BadMagic {
        /// The bytes found where the magic should be (fewer if the stream was shorter).
        found: Vec<u8>,
    },
    /// The header's version is not one this code knows.
    #[error("unsupported migration stream version {got} (this kumo reads version {supported})")]
    UnsupportedVersion {
        /// Version in the stream.
        got: u32,
        /// Version this code reads.
        supported: u32,
    },
    /// The input ended in the middle of something.
    #[error("migration stream truncated: input ended inside the {what}")]
    Truncated {
        /// What was being read.
        what: &'static str,
    },
    /// The stream header's CRC does not match.
    #[error("migration stream header checksum mismatch")]
    HeaderChecksumMismatch,
    /// A record's CRC does not match.
    #[error("checksum mismatch in record {seq} ({tag})")]
    ChecksumMismatch {
        /// Position of the record in its stream (0, 1, 2, …).
        seq: u64,
        /// The record's tag.
        tag: Tag,
    },
    /// A record carries a sequence number other than the next one: a record was lost,
    /// duplicated or reordered.
    #[error("record out of sequence: expected seq {expected}, got {got}")]
    BadSequence {
        /// The next sequence number.
        expected: u64,
        /// The one in the record.
        got: u64,
    },
    /// A tag that is not valid in this direction of the connection.
    #[error("unknown record tag {0:#04x}")]
    UnknownTag(u8),
    /// A length field above its bound (checked before anything is allocated).
    #[error("{what} too large: {len} exceeds the maximum of {max}")]
    Oversized {
        /// What the length is of.
        what: &'static str,
        /// The length found.
        len: u64,
        /// Its bound.
        max: u64,
    },
    /// A `MemBatch` names a page outside the described guest memory.
    #[error("page frame {gfn:#x} lies outside guest memory ({memory_bytes} bytes)")]
    PageOutOfRange {
        /// The offending guest page frame number.
        gfn: u64,
        /// Guest memory size from the description.
        memory_bytes: u64,
    },
    /// The header's VM description is not valid.
    #[error("bad VM description: {0}")]
    BadDescription(String),
    /// A record is malformed or out of place in the record grammar, or a caller asked the
    /// encoder for such a record.
    #[error("bad record {seq}: {reason}")]
    BadRecord {
        /// Position of the record in its stream.
        seq: u64,
        /// What is wrong.
        reason: String,
    },
    /// The receiver could not find guest memory for a batch it reads in place.
    #[error("cannot place page data: {0}")]
    Placement(String),
    /// The underlying reader or writer failed.
    #[error("migration stream I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Result with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Record tags. `0x01..=0x06` go sender → receiver, `0x81..=0x85` receiver → sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tag {
    /// A batch of guest pages.
    MemBatch = 1,
    /// End of a pre-copy round.
    RoundEnd = 2,
    /// Opaque vCPU/irqchip/clock state.
    State = 3,
    /// End of a successful stream.
    Complete = 4,
    /// The sender gives up.
    Abort = 5,
    /// Runs of guest pages that hold only zeros.
    ZeroPages = 6,
    /// Reply: header accepted, send records.
    Ready = 0x81,
    /// Reply: the destination runs the VM.
    Resumed = 0x82,
    /// Reply: the destination failed.
    Failed = 0x83,
    /// Reply: a batch sent with [`FLAG_ACK`] is in guest memory.
    Placed = 0x84,
    /// Reply: the header was read and is valid; the destination is building the VM. Sent at
    /// once, so a sender learns within a round trip that it talks to a kumo destination.
    Accepted = 0x85,
}

impl Tag {
    /// The tag for a byte, if it is one.
    pub fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            1 => Tag::MemBatch,
            2 => Tag::RoundEnd,
            3 => Tag::State,
            4 => Tag::Complete,
            5 => Tag::Abort,
            6 => Tag::ZeroPages,
            0x81 => Tag::Ready,
            0x82 => Tag::Resumed,
            0x83 => Tag::Failed,
            0x84 => Tag::Placed,
            0x85 => Tag::Accepted,
            _ => return None,
        })
    }

    /// Whether this is a receiver → sender reply.
    pub fn is_reply(self) -> bool {
        self as u8 & 0x80 != 0
    }

    /// Largest body this tag may carry. Fixed-size bodies are checked exactly when parsed.
    pub fn max_body_len(self) -> usize {
        match self {
            Tag::MemBatch => MAX_BATCH_BODY,
            Tag::RoundEnd => 12,
            Tag::ZeroPages => MAX_ZERO_BODY,
            Tag::State => MAX_STATE_LEN,
            Tag::Complete | Tag::Placed => 8,
            Tag::Abort | Tag::Failed => MAX_REASON_LEN,
            Tag::Ready | Tag::Resumed | Tag::Accepted => 0,
        }
    }

    /// Flags this tag may carry.
    fn allowed_flags(self) -> u8 {
        if self == Tag::MemBatch {
            FLAG_DATA_UNCHECKED | FLAG_ACK
        } else {
            0
        }
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

// ---------------------------------------------------------------------------------------------
// Stream header

mod description;
pub use description::*;

/// The bytes of a stream header for `desc` (for senders that write to a raw socket).
pub fn encode_header(desc: &VmDescription) -> Result<Vec<u8>> {
    desc.validate()?;
    let json = serde_json::to_vec(desc).map_err(|e| Error::BadDescription(e.to_string()))?;
    if json.len() > MAX_DESC_LEN {
        return Err(Error::Oversized { what: "VM description", len: json.len() as u64, max: MAX_DESC_LEN as u64 });
    }
    let mut out = Vec::with_capacity(HEADER_FIXED_LEN + json.len() + TRAILER_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Writes the stream header for `desc` (validated first, so a sender never starts a stream
/// the receiver must reject).
pub fn write_header<W: Write + ?Sized>(w: &mut W, desc: &VmDescription) -> Result<()> {
    w.write_all(&encode_header(desc)?)?;
    Ok(())
}

/// Reads and checks a stream header: magic, then version (before anything else, so an
/// unknown version is reported as such), then the description's length, CRC and contents.
pub fn read_header<R: Read + ?Sized>(r: &mut R) -> Result<VmDescription> {
    const WHAT: &str = "stream header";
    let mut fixed = [0u8; HEADER_FIXED_LEN];
    let n = read_full(r, &mut fixed[..8])?;
    if fixed[..n] != MAGIC[..n] {
        return Err(Error::BadMagic { found: fixed[..n].to_vec() });
    }
    if n < 8 {
        return Err(Error::Truncated { what: WHAT });
    }
    read_exact(r, &mut fixed[8..], WHAT)?;
    let version = le_u32(&fixed[8..12]);
    if version != VERSION {
        return Err(Error::UnsupportedVersion { got: version, supported: VERSION });
    }
    let desc_len = le_u32(&fixed[12..16]) as usize;
    if desc_len > MAX_DESC_LEN {
        return Err(Error::Oversized { what: "VM description", len: desc_len as u64, max: MAX_DESC_LEN as u64 });
    }
    let mut rest = vec![0u8; desc_len + TRAILER_LEN];
    read_exact(r, &mut rest, WHAT)?;
    let mut h = crc32fast::Hasher::new();
    h.update(&fixed);
    h.update(&rest[..desc_len]);
    if h.finalize() != le_u32(&rest[desc_len..]) {
        return Err(Error::HeaderChecksumMismatch);
    }
    let desc: VmDescription =
        serde_json::from_slice(&rest[..desc_len]).map_err(|e| Error::BadDescription(e.to_string()))?;
    desc.validate()?;
    Ok(desc)
}

// ---------------------------------------------------------------------------------------------
// Encoding

/// Which bytes of a `MemBatch` its CRC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checksum {
    /// Frame header, metadata and page data. Copying senders, and every batch of the final
    /// (paused) round.
    Full,
    /// Frame header and metadata only (flag [`FLAG_DATA_UNCHECKED`]): for page data sent
    /// straight from live guest memory, which may change while it is on its way.
    MetadataOnly,
}

/// Turns records into frames and numbers them. No I/O: bytes go into caller buffers, so a
/// zero-copy sender can put them into its own `sendmsg` iovecs. Use one encoder per
/// direction of a connection.
#[derive(Debug, Default, Clone)]
pub struct Encoder {
    seq: u64,
}

fn frame_header(tag: Tag, flags: u8, len: usize, seq: u64) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0] = tag as u8;
    h[1] = flags;
    // h[2..4]: reserved, zero.
    h[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Encoder {
    /// An encoder whose first frame gets seq 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq the next frame gets.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Appends a whole frame. Validation happens before this, so a rejected record never
    /// uses up a seq.
    fn frame(&mut self, out: &mut Vec<u8>, tag: Tag, body: &[&[u8]]) {
        let len = body.iter().map(|b| b.len()).sum();
        let start = out.len();
        out.extend_from_slice(&frame_header(tag, 0, len, self.seq));
        for b in body {
            out.extend_from_slice(b);
        }
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
        self.seq += 1;
    }

    /// Starts a `MemBatch` frame whose page data the caller sends itself: send
    /// [`BatchFrame::head`], then the `gfns.len()` pages in gfn order (feeding them to
    /// [`BatchFrame::update`] if `checksum` is [`Checksum::Full`]), then
    /// [`BatchFrame::trailer`]. Apart from the flag and the CRC's coverage, the bytes are
    /// those of [`Encoder::mem_batch`].
    ///
    /// With `ack`, the receiver answers with [`Reply::Placed`] once the pages are in place.
    pub fn batch_frame(&mut self, round: u32, gfns: &[u64], checksum: Checksum, ack: bool) -> Result<BatchFrame> {
        let count = gfns.len();
        if count == 0 {
            return Err(Error::BadRecord { seq: self.seq, reason: "empty page batch".into() });
        }
        if count > MAX_BATCH_PAGES {
            return Err(Error::Oversized { what: "page batch", len: count as u64, max: MAX_BATCH_PAGES as u64 });
        }
        if let Some(w) = gfns.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::BadRecord {
                seq: self.seq,
                reason: format!("page frames out of order in a batch ({:#x} before {:#x})", w[0], w[1]),
            });
        }
        let mut flags = match checksum {
            Checksum::Full => 0,
            Checksum::MetadataOnly => FLAG_DATA_UNCHECKED,
        };
        if ack {
            flags |= FLAG_ACK;
        }
        let mut head = Vec::with_capacity(FRAME_HEADER_LEN + batch_meta_len(count));
        head.extend_from_slice(&frame_header(Tag::MemBatch, flags, batch_body_len(count), self.seq));
        head.extend_from_slice(&round.to_le_bytes());
        head.extend_from_slice(&(count as u32).to_le_bytes());
        for gfn in gfns {
            head.extend_from_slice(&gfn.to_le_bytes());
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&head);
        let frame = BatchFrame { head, hasher, checksum, seq: self.seq, data_len: count * PAGE, fed: 0 };
        self.seq += 1;
        Ok(frame)
    }

    /// Appends a fully checked `MemBatch` of pages already copied into `data`
    /// (`gfns.len() * 4096` bytes, in gfn order).
    pub fn mem_batch(&mut self, out: &mut Vec<u8>, round: u32, gfns: &[u64], data: &[u8]) -> Result<()> {
        check_data_len(self.seq, gfns.len(), data.len())?;
        let mut f = self.batch_frame(round, gfns, Checksum::Full, false)?;
        f.update(data);
        out.extend_from_slice(f.head());
        out.extend_from_slice(data);
        out.extend_from_slice(&f.trailer()?);
        Ok(())
    }

    /// Appends a `ZeroPages` record: the pages of `runs` (first gfn, pages), in increasing and
    /// disjoint order, hold only zeros. They count as sent pages of round `round`.
    pub fn zero_pages(&mut self, out: &mut Vec<u8>, round: u32, runs: &[(u64, u64)]) -> Result<()> {
        let seq = self.seq;
        if runs.is_empty() || runs.len() > MAX_ZERO_RUNS {
            return Err(Error::BadRecord { seq, reason: format!("{} zero runs (1 to {MAX_ZERO_RUNS})", runs.len()) });
        }
        check_zero_runs(seq, runs)?;
        let mut body = Vec::with_capacity(8 + runs.len() * 16);
        body.extend_from_slice(&round.to_le_bytes());
        body.extend_from_slice(&(runs.len() as u32).to_le_bytes());
        for &(gfn, n) in runs {
            body.extend_from_slice(&gfn.to_le_bytes());
            body.extend_from_slice(&n.to_le_bytes());
        }
        self.frame(out, Tag::ZeroPages, &[&body]);
        Ok(())
    }

    /// Appends a `RoundEnd`: round `round` is over, having sent `pages` pages.
    pub fn round_end(&mut self, out: &mut Vec<u8>, round: u32, pages: u64) {
        self.frame(out, Tag::RoundEnd, &[&round.to_le_bytes(), &pages.to_le_bytes()]);
    }

    /// Appends the VM's opaque device/vCPU state (at most [`MAX_STATE_LEN`] bytes).
    pub fn state(&mut self, out: &mut Vec<u8>, state: &[u8]) -> Result<()> {
        if state.len() > MAX_STATE_LEN {
            return Err(Error::Oversized { what: "VM state", len: state.len() as u64, max: MAX_STATE_LEN as u64 });
        }
        self.frame(out, Tag::State, &[state]);
        Ok(())
    }

    /// Appends `Complete` with the number of pages sent over all rounds.
    pub fn complete(&mut self, out: &mut Vec<u8>, total_pages: u64) {
        self.frame(out, Tag::Complete, &[&total_pages.to_le_bytes()]);
    }

    /// Appends `Abort`. The reason is cut to [`MAX_REASON_LEN`] bytes: an abort must always
    /// be sendable.
    pub fn abort(&mut self, out: &mut Vec<u8>, reason: &str) {
        self.frame(out, Tag::Abort, &[clip(reason, MAX_REASON_LEN).as_bytes()]);
    }

    /// Appends a receiver → sender reply (reasons cut as for [`Encoder::abort`]).
    pub fn reply(&mut self, out: &mut Vec<u8>, reply: &Reply) {
        match reply {
            Reply::Accepted => self.frame(out, Tag::Accepted, &[]),
            Reply::Ready => self.frame(out, Tag::Ready, &[]),
            Reply::Resumed => self.frame(out, Tag::Resumed, &[]),
            Reply::Failed(r) => self.frame(out, Tag::Failed, &[clip(r, MAX_REASON_LEN).as_bytes()]),
            Reply::Placed(seq) => self.frame(out, Tag::Placed, &[&seq.to_le_bytes()]),
        }
    }
}

/// Zero runs must be non-empty, increasing and disjoint, and not wrap past 2^64.
fn check_zero_runs(seq: u64, runs: &[(u64, u64)]) -> Result<()> {
    let mut next = 0u64;
    for (i, &(gfn, n)) in runs.iter().enumerate() {
        let bad = |reason: String| Err(Error::BadRecord { seq, reason });
        if n == 0 {
            return bad(format!("empty zero run at {gfn:#x}"));
        }
        if i > 0 && gfn < next {
            return bad(format!("zero runs out of order or overlapping at {gfn:#x}"));
        }
        let Some(end) = gfn.checked_add(n) else {
            return bad(format!("zero run at {gfn:#x} of {n} pages wraps"));
        };
        next = end;
    }
    Ok(())
}

fn check_data_len(seq: u64, count: usize, data_len: usize) -> Result<()> {
    if data_len != count * PAGE {
        return Err(Error::BadRecord {
            seq,
            reason: format!("{data_len} bytes of page data for {count} pages (need {})", count * PAGE),
        });
    }
    Ok(())
}

/// A `MemBatch` frame whose page data is sent by the caller (see [`Encoder::batch_frame`]).
#[derive(Debug, Clone)]
pub struct BatchFrame {
    head: Vec<u8>,
    hasher: crc32fast::Hasher,
    checksum: Checksum,
    seq: u64,
    data_len: usize,
    fed: usize,
}

impl BatchFrame {
    /// Frame header and metadata (round, count, gfns): send these bytes first.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// The frame's seq.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Bytes of page data that must follow the head.
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// What the CRC covers.
    pub fn checksum(&self) -> Checksum {
        self.checksum
    }

    /// Feeds page data, in order and in pieces of any size, to the CRC. Does nothing for
    /// [`Checksum::MetadataOnly`], so callers may feed unconditionally.
    pub fn update(&mut self, data: &[u8]) {
        if self.checksum == Checksum::Full {
            self.hasher.update(data);
            self.fed += data.len();
        }
    }

    /// The 4-byte trailer that follows the page data. For [`Checksum::Full`] it fails unless
    /// exactly [`BatchFrame::data_len`] bytes were fed.
    pub fn trailer(&self) -> Result<[u8; TRAILER_LEN]> {
        if self.checksum == Checksum::Full && self.fed != self.data_len {
            return Err(Error::BadRecord {
                seq: self.seq,
                reason: format!("{} bytes of page data fed to the checksum, need {}", self.fed, self.data_len),
            });
        }
        Ok(self.hasher.clone().finalize().to_le_bytes())
    }
}

/// An [`Encoder`] writing to `W`. Wrap sockets in a [`std::io::BufWriter`]: small records
/// are written in a few `write_all` calls.
#[derive(Debug)]
pub struct Writer<W> {
    inner: W,
    enc: Encoder,
    buf: Vec<u8>,
}

impl<W: Write> Writer<W> {
    /// A writer whose first record gets seq 0. Write the header first ([`write_header`]), or
    /// use [`Writer::start`].
    pub fn new(inner: W) -> Self {
        Writer { inner, enc: Encoder::new(), buf: Vec::new() }
    }

    /// Writes the stream header for `desc` and returns a writer for the records.
    pub fn start(mut inner: W, desc: &VmDescription) -> Result<Self> {
        write_header(&mut inner, desc)?;
        Ok(Self::new(inner))
    }

    /// The seq the next record gets.
    pub fn seq(&self) -> u64 {
        self.enc.seq()
    }

    /// Writes a fully checked `MemBatch` of pages copied into `data` (gfn order).
    pub fn mem_batch(&mut self, round: u32, gfns: &[u64], data: &[u8]) -> Result<()> {
        self.mem_batch_vectored(round, gfns, &[data], Checksum::Full)
    }

    /// Writes a `MemBatch` whose page data lies in `data` slices of any size (e.g. one per
    /// page, pointing into guest memory), `gfns.len() * 4096` bytes in all.
    pub fn mem_batch_vectored(&mut self, round: u32, gfns: &[u64], data: &[&[u8]], checksum: Checksum) -> Result<()> {
        check_data_len(self.enc.seq(), gfns.len(), data.iter().map(|d| d.len()).sum())?;
        let mut f = self.enc.batch_frame(round, gfns, checksum, false)?;
        for d in data {
            f.update(d);
        }
        self.inner.write_all(f.head())?;
        for d in data {
            self.inner.write_all(d)?;
        }
        self.inner.write_all(&f.trailer()?)?;
        Ok(())
    }

    /// Writes a `ZeroPages` record (see [`Encoder::zero_pages`]).
    pub fn zero_pages(&mut self, round: u32, runs: &[(u64, u64)]) -> Result<()> {
        self.enc.zero_pages(&mut self.buf, round, runs)?;
        self.flush_buf()
    }

    /// Writes a `RoundEnd`.
    pub fn round_end(&mut self, round: u32, pages: u64) -> Result<()> {
        self.enc.round_end(&mut self.buf, round, pages);
        self.flush_buf()
    }

    /// Writes the VM's opaque state.
    pub fn state(&mut self, state: &[u8]) -> Result<()> {
        // Header and trailer go around the caller's bytes; no copy of a big state.
        if state.len() > MAX_STATE_LEN {
            return Err(Error::Oversized { what: "VM state", len: state.len() as u64, max: MAX_STATE_LEN as u64 });
        }
        let head = frame_header(Tag::State, 0, state.len(), self.enc.seq);
        let mut h = crc32fast::Hasher::new();
        h.update(&head);
        h.update(state);
        self.enc.seq += 1;
        self.inner.write_all(&head)?;
        self.inner.write_all(state)?;
        self.inner.write_all(&h.finalize().to_le_bytes())?;
        Ok(())
    }

    /// Writes `Complete`.
    pub fn complete(&mut self, total_pages: u64) -> Result<()> {
        self.enc.complete(&mut self.buf, total_pages);
        self.flush_buf()
    }

    /// Writes `Abort`.
    pub fn abort(&mut self, reason: &str) -> Result<()> {
        self.enc.abort(&mut self.buf, reason);
        self.flush_buf()
    }

    /// Writes a reply (receiver side; use a separate writer from the record stream's).
    pub fn reply(&mut self, reply: &Reply) -> Result<()> {
        self.enc.reply(&mut self.buf, reply);
        self.flush_buf()
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> Result<()> {
        self.inner.flush()?;
        Ok(())
    }

    fn flush_buf(&mut self) -> Result<()> {
        let r = self.inner.write_all(&self.buf);
        self.buf.clear();
        Ok(r?)
    }

    /// The underlying writer.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// The underlying writer, mutably.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Unwraps the writer.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// `read` until `buf` is full or EOF; returns the bytes read.
fn read_full<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn read_exact<R: Read + ?Sized>(r: &mut R, buf: &mut [u8], what: &'static str) -> Result<()> {
    if read_full(r, buf)? < buf.len() {
        return Err(Error::Truncated { what });
    }
    Ok(())
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// A checked frame; its body is `FrameReader::buf[..len]`.
struct Frame {
    tag: Tag,
    flags: u8,
    len: usize,
}

/// Frame-level reading shared by [`Reader`] and [`ReplyReader`]: bounds, CRC, seq.
#[derive(Debug, Default)]
struct FrameReader {
    seq: u64,
    buf: Vec<u8>,
    /// Set by any error: the stream position is then unknown, so reading stops.
    failed: bool,
}

/// A frame header whose fields passed the checks that need no body.
struct Head {
    hdr: [u8; FRAME_HEADER_LEN],
    tag: Tag,
    flags: u8,
    len: usize,
}

impl FrameReader {
    /// The next frame, or `None` on EOF exactly at a frame boundary.
    fn read<R: Read + ?Sized>(&mut self, r: &mut R, replies: bool) -> Result<Option<Frame>> {
        let res = match self.read_head(r, replies) {
            Ok(Some(head)) => self.read_body(r, &head).map(Some),
            other => other.map(|_| None),
        };
        self.failed |= res.is_err();
        res
    }

    /// Reads a frame header and checks its tag, length bound, flags and reserved bytes.
    fn read_head<R: Read + ?Sized>(&mut self, r: &mut R, replies: bool) -> Result<Option<Head>> {
        if self.failed {
            return Err(Error::BadRecord { seq: self.seq, reason: "the stream already failed".into() });
        }
        let mut hdr = [0u8; FRAME_HEADER_LEN];
        match read_full(r, &mut hdr)? {
            0 => return Ok(None),
            FRAME_HEADER_LEN => {}
            _ => return Err(Error::Truncated { what: "record header" }),
        }
        let tag = match Tag::from_u8(hdr[0]) {
            Some(t) if t.is_reply() == replies => t,
            _ => return Err(Error::UnknownTag(hdr[0])),
        };
        let len = le_u32(&hdr[4..8]) as usize;
        if len > tag.max_body_len() {
            return Err(Error::Oversized { what: "record body", len: len as u64, max: tag.max_body_len() as u64 });
        }
        let (flags, seq) = (hdr[1], self.seq);
        if flags & !tag.allowed_flags() != 0 {
            return Err(Error::BadRecord { seq, reason: format!("unknown flags {flags:#04x} on {tag}") });
        }
        if hdr[2..4] != [0, 0] {
            return Err(Error::BadRecord { seq, reason: "reserved bytes are not zero".into() });
        }
        Ok(Some(Head { hdr, tag, flags, len }))
    }

    /// Reads the body and trailer of `head` into `buf` and checks the CRC and seq.
    fn read_body<R: Read + ?Sized>(&mut self, r: &mut R, head: &Head) -> Result<Frame> {
        let &Head { hdr, tag, flags, len } = head;
        // Reused across records and never shrunk: after the first full batch, reading neither
        // allocates nor zero-fills.
        if self.buf.len() < len + TRAILER_LEN {
            self.buf.resize(len + TRAILER_LEN, 0);
        }
        read_exact(r, &mut self.buf[..len + TRAILER_LEN], "record body")?;
        let seq = self.seq;
        // The CRC covers all of the body except the page data of an unchecked batch; finding
        // that boundary needs the page count, bounded before it is used.
        let covered = if flags & FLAG_DATA_UNCHECKED != 0 {
            if len < 8 {
                return Err(Error::BadRecord { seq, reason: "batch shorter than its metadata".into() });
            }
            let count = le_u32(&self.buf[4..8]) as usize;
            if count > MAX_BATCH_PAGES {
                return Err(Error::Oversized { what: "page batch", len: count as u64, max: MAX_BATCH_PAGES as u64 });
            }
            if batch_meta_len(count) > len {
                return Err(Error::BadRecord { seq, reason: format!("batch of {count} pages in a {len}-byte body") });
            }
            batch_meta_len(count)
        } else {
            len
        };
        let mut h = crc32fast::Hasher::new();
        h.update(&hdr);
        h.update(&self.buf[..covered]);
        self.finish(&hdr, tag, h.finalize(), le_u32(&self.buf[len..]))?;
        Ok(Frame { tag, flags, len })
    }

    /// Checks a frame's CRC, then its seq (after the CRC, so corruption reads as corruption
    /// and a bad seq means a record really went missing or came twice), and counts it.
    fn finish(&mut self, hdr: &[u8; FRAME_HEADER_LEN], tag: Tag, crc: u32, trailer: u32) -> Result<()> {
        let seq = self.seq;
        if crc != trailer {
            return Err(Error::ChecksumMismatch { seq, tag });
        }
        let got = le_u64(&hdr[8..16]);
        if got != seq {
            return Err(Error::BadSequence { expected: seq, got });
        }
        self.seq += 1;
        Ok(())
    }
}

/// Guest page frame ranges, sorted, for the per-page range check.
#[derive(Debug, Clone)]
struct GfnMap {
    ranges: Vec<(u64, u64)>, // [start, end) in page frames
    memory_bytes: u64,
}

impl GfnMap {
    fn new(desc: &VmDescription) -> Self {
        let p = PAGE as u64;
        let mut ranges: Vec<_> =
            desc.regions.iter().map(|&(gpa, len)| (gpa / p, (gpa / p).saturating_add(len / p))).collect();
        ranges.sort_unstable();
        GfnMap { ranges, memory_bytes: desc.memory_bytes }
    }

    fn contains(&self, gfn: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.1 <= gfn);
        self.ranges.get(i).is_some_and(|r| r.0 <= gfn)
    }

    /// Whether the `n` pages from `gfn` all lie in one described region.
    fn contains_run(&self, gfn: u64, n: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.1 <= gfn);
        self.ranges.get(i).is_some_and(|r| r.0 <= gfn && gfn.checked_add(n).is_some_and(|end| end <= r.1))
    }
}

/// A batch of pages read from the stream, borrowed from the reader's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch<'a> {
    /// The round it belongs to.
    pub round: u32,
    /// Guest page frame numbers, all within the described memory.
    pub gfns: &'a [u64],
    /// `gfns.len() * 4096` bytes of page data, in gfn order; empty when the reader placed
    /// the data itself ([`Reader::next_record_placed`]).
    pub data: &'a [u8],
    /// Whether the CRC covered the page data (false for zero-copy batches of live rounds).
    pub checked: bool,
    /// The batch's seq, which a [`Reply::Placed`] names.
    pub seq: u64,
    /// The sender waits for [`Reply::Placed`] ([`FLAG_ACK`]).
    pub ack: bool,
}

/// Guest memory a [`Reader`] reads page data straight into ([`Reader::next_record_placed`]),
/// so the receiver does not copy pages out of a buffer.
pub trait PagePlacer {
    /// Buffers for the page data of `runs`, each `(first gfn, pages)` of contiguous frames
    /// and `pages * 4096` bytes long, in stream order. The reader has checked that the runs
    /// are disjoint and inside the described memory before it asks.
    fn buffers(&mut self, runs: &[(u64, usize)]) -> std::result::Result<Vec<io::IoSliceMut<'_>>, String>;
}

/// Whether `page` holds only zeros: a sender may send it in a `ZeroPages` run. Blocks of 64
/// bytes are OR-ed without a branch (that vectorizes); the first non-zero block ends the scan.
pub fn is_zero_page(page: &[u8]) -> bool {
    page.chunks(64).all(|c| c.iter().fold(0u8, |a, &x| a | x) == 0)
}

/// Takes the pages `is_zero(i)` names (by index) out of `gfns`, and their data out of `data`
/// when it holds the pages (`gfns.len() * 4096` bytes; empty otherwise): the rest is moved to
/// the front, in order, and `gfns` shortened. Returns the zero pages as runs for
/// [`Encoder::zero_pages`] (at most [`MAX_ZERO_RUNS`] for a batch of [`MAX_BATCH_PAGES`]).
pub fn split_zero_pages(gfns: &mut Vec<u64>, data: &mut [u8], is_zero: impl Fn(usize) -> bool) -> Vec<(u64, u64)> {
    let copied = !data.is_empty();
    let (mut runs, mut keep) = (Vec::<(u64, u64)>::new(), 0);
    for i in 0..gfns.len() {
        let g = gfns[i];
        if is_zero(i) {
            match runs.last_mut() {
                Some((first, n)) if *first + *n == g => *n += 1,
                _ => runs.push((g, 1)),
            }
            continue;
        }
        gfns[keep] = g;
        if copied && keep != i {
            data.copy_within(i * PAGE..(i + 1) * PAGE, keep * PAGE);
        }
        keep += 1;
    }
    gfns.truncate(keep);
    runs
}

/// The runs of contiguous gfns in `gfns`, as (first gfn, pages).
pub fn gfn_runs(gfns: &[u64]) -> impl Iterator<Item = (u64, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= gfns.len() {
            return None;
        }
        let start = i;
        i += 1;
        while i < gfns.len() && gfns[i] == gfns[i - 1] + 1 {
            i += 1;
        }
        Some((gfns[start], i - start))
    })
}

/// `read_vectored` until every buffer is full.
fn read_exact_vectored<R: Read + ?Sized>(
    r: &mut R,
    mut bufs: &mut [io::IoSliceMut<'_>],
    what: &'static str,
) -> Result<()> {
    while !bufs.is_empty() {
        match r.read_vectored(bufs) {
            Ok(0) => return Err(Error::Truncated { what }),
            Ok(n) => io::IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

impl<'a> Batch<'a> {
    /// The pages as `(gfn, 4096-byte page)`.
    pub fn pages(&self) -> impl Iterator<Item = (u64, &'a [u8])> + 'a {
        self.gfns.iter().copied().zip(self.data.chunks_exact(PAGE))
    }
}

/// A record read from the stream. Borrowed data lives until the next read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// Guest pages.
    MemBatch(Batch<'a>),
    /// Guest pages that hold only zeros, as runs of (first gfn, pages): increasing, disjoint,
    /// each inside one described region (checked by the reader).
    ZeroPages {
        /// The round they belong to.
        round: u32,
        /// The runs.
        runs: &'a [(u64, u64)],
    },
    /// A round is over; `pages` is the number of pages it sent (checked by the reader).
    RoundEnd {
        /// The round.
        round: u32,
        /// Pages sent in it.
        pages: u64,
    },
    /// The VM's opaque state.
    State(&'a [u8]),
    /// The stream is complete; `total_pages` were sent over all rounds (checked).
    Complete {
        /// Pages sent in all rounds.
        total_pages: u64,
    },
    /// The sender gave up; the stream ends here.
    Abort(&'a str),
}

/// A checked record, before it borrows the reader's buffers.
enum Parsed {
    MemBatch { round: u32, count: usize, len: usize, checked: bool, seq: u64, ack: bool, placed: bool },
    ZeroPages { round: u32 },
    RoundEnd { round: u32, pages: u64 },
    State { len: usize },
    Complete { total_pages: u64 },
    Abort { len: usize },
}

/// Reads and checks the records of a stream (receiver side).
///
/// Besides framing it enforces the record grammar, so a receiver that gets `Complete` has
/// all of a well-formed stream:
/// - batches carry the current round (0, then +1 after each `RoundEnd`), and every gfn lies
///   in the described memory;
/// - `RoundEnd` names the current round and the number of pages its batches carried;
/// - `State` comes exactly once, before `Complete`;
/// - `Complete` comes at a round boundary, carries the total of all rounds, and the last
///   round before it is fully checked (no unchecked batches);
/// - `Complete` or `Abort` ends the stream: after them the reader returns `Ok(None)` without
///   touching the input (the receiver can reply on the same connection), while EOF before
///   them is [`Error::Truncated`].
#[derive(Debug)]
pub struct Reader<R> {
    inner: R,
    frames: FrameReader,
    gfn_map: GfnMap,
    gfns: Vec<u64>,
    zero_runs: Vec<(u64, u64)>,
    round: u32,
    round_pages: u64,
    round_unchecked: bool,
    last_round_unchecked: bool,
    total_pages: u64,
    state_seen: bool,
    /// False on the extra connections of a multi-connection stream: only the first carries State.
    expect_state: bool,
    finished: bool,
}

impl<R: Read> Reader<R> {
    /// A reader for the records after a header describing `desc`.
    pub fn new(inner: R, desc: &VmDescription) -> Self {
        Reader {
            inner,
            frames: FrameReader::default(),
            gfn_map: GfnMap::new(desc),
            gfns: Vec::with_capacity(MAX_BATCH_PAGES),
            zero_runs: Vec::new(),
            round: 0,
            round_pages: 0,
            round_unchecked: false,
            last_round_unchecked: false,
            total_pages: 0,
            state_seen: false,
            expect_state: true,
            finished: false,
        }
    }

    /// A reader for an extra connection of a multi-connection stream, which carries no State.
    pub fn secondary(inner: R, desc: &VmDescription) -> Self {
        Reader { expect_state: false, ..Self::new(inner, desc) }
    }

    /// Reads the header, then returns a reader for the records and the description.
    pub fn open(mut inner: R) -> Result<(Self, VmDescription)> {
        let desc = read_header(&mut inner)?;
        Ok((Self::new(inner, &desc), desc))
    }

    /// The next record; `Ok(None)` once `Complete` or `Abort` has been read.
    pub fn next_record(&mut self) -> Result<Option<Record<'_>>> {
        self.next(None)
    }

    /// Like [`Reader::next_record`], but page data goes straight into the buffers `placer`
    /// gives, checked against the CRC there, and the batch's `data` is empty. Page frames are
    /// range-checked before any byte is placed, but the CRC can only be checked after: on an
    /// error, the placed memory may hold bad data (a receiver discards that VM anyway).
    pub fn next_record_placed(&mut self, placer: &mut dyn PagePlacer) -> Result<Option<Record<'_>>> {
        self.next(Some(placer))
    }

    fn next(&mut self, placer: Option<&mut dyn PagePlacer>) -> Result<Option<Record<'_>>> {
        if self.finished {
            return Ok(None);
        }
        // Checking and borrowing are separate steps: the record borrows the buffers only
        // once every check has passed.
        let parsed = match self.advance(placer) {
            Ok(p) => p,
            Err(e) => {
                self.frames.failed = true;
                return Err(e);
            }
        };
        let buf = &self.frames.buf;
        Ok(Some(match parsed {
            Parsed::MemBatch { round, count, len, checked, seq, ack, placed } => {
                let data = if placed { &[][..] } else { &buf[batch_meta_len(count)..len] };
                Record::MemBatch(Batch { round, gfns: &self.gfns, data, checked, seq, ack })
            }
            Parsed::ZeroPages { round } => Record::ZeroPages { round, runs: &self.zero_runs },
            Parsed::RoundEnd { round, pages } => Record::RoundEnd { round, pages },
            Parsed::State { len } => Record::State(&buf[..len]),
            Parsed::Complete { total_pages } => Record::Complete { total_pages },
            Parsed::Abort { len } => Record::Abort(std::str::from_utf8(&buf[..len]).unwrap_or_default()),
        }))
    }

    /// Checks a batch's first 8 body bytes (round, count) against its length, flags and the
    /// current round; returns the count.
    fn batch_count(&self, seq: u64, flags: u8, len: usize, first8: &[u8]) -> Result<usize> {
        let bad = |reason: String| Err(Error::BadRecord { seq, reason });
        if len < 8 {
            return bad("batch shorter than its metadata".into());
        }
        let round = le_u32(&first8[0..4]);
        let count = le_u32(&first8[4..8]) as usize;
        if count > MAX_BATCH_PAGES {
            return Err(Error::Oversized { what: "page batch", len: count as u64, max: MAX_BATCH_PAGES as u64 });
        }
        if count == 0 || len != batch_body_len(count) {
            return bad(format!("batch of {count} pages in a {len}-byte body"));
        }
        if round != self.round {
            return bad(format!("batch for round {round} during round {}", self.round));
        }
        if flags & FLAG_ACK != 0 && !self.expect_state {
            return bad("acknowledged batch on an extra connection".into());
        }
        Ok(count)
    }

    /// Parses a batch's gfns into `gfns`: each inside guest memory, strictly increasing (so
    /// a batch never names a page twice and its runs are disjoint).
    fn load_gfns(gfns: &mut Vec<u64>, map: &GfnMap, seq: u64, raw: &[u8]) -> Result<()> {
        gfns.clear();
        for g in raw.chunks_exact(8) {
            let gfn = le_u64(g);
            if !map.contains(gfn) {
                return Err(Error::PageOutOfRange { gfn, memory_bytes: map.memory_bytes });
            }
            if gfns.last().is_some_and(|&l| l >= gfn) {
                return Err(Error::BadRecord {
                    seq,
                    reason: format!("page frames out of order ({gfn:#x} after {:#x})", gfns[gfns.len() - 1]),
                });
            }
            gfns.push(gfn);
        }
        Ok(())
    }

    /// Checks a `ZeroPages` body of round `round` and loads its runs into `runs`; returns
    /// the pages they cover.
    fn load_zero_runs(runs: &mut Vec<(u64, u64)>, map: &GfnMap, seq: u64, round: u32, body: &[u8]) -> Result<u64> {
        let bad = |reason: String| Err(Error::BadRecord { seq, reason });
        if body.len() < 8 {
            return bad("ZeroPages shorter than its round and count".into());
        }
        let (got, count) = (le_u32(&body[0..4]), le_u32(&body[4..8]) as usize);
        if count == 0 || count > MAX_ZERO_RUNS || body.len() != 8 + count * 16 {
            return bad(format!("ZeroPages of {count} runs in a {}-byte body", body.len()));
        }
        if got != round {
            return bad(format!("zero pages for round {got} during round {round}"));
        }
        runs.clear();
        runs.extend(body[8..].chunks_exact(16).map(|r| (le_u64(&r[0..8]), le_u64(&r[8..16]))));
        check_zero_runs(seq, runs)?;
        let mut pages = 0u64;
        for &(gfn, n) in runs.iter() {
            if !map.contains_run(gfn, n) {
                return Err(Error::PageOutOfRange { gfn, memory_bytes: map.memory_bytes });
            }
            pages += n;
        }
        Ok(pages)
    }

    /// Counts a checked batch into its round.
    fn commit_batch(&mut self, seq: u64, flags: u8, count: usize, len: usize, placed: bool) -> Parsed {
        let checked = flags & FLAG_DATA_UNCHECKED == 0;
        self.round_pages += count as u64;
        self.round_unchecked |= !checked;
        Parsed::MemBatch { round: self.round, count, len, checked, seq, ack: flags & FLAG_ACK != 0, placed }
    }

    /// Reads a batch whose header is `head`, placing its page data with `placer`.
    fn place_batch(&mut self, head: &Head, placer: &mut dyn PagePlacer) -> Result<Parsed> {
        let seq = self.frames.seq;
        let buf = &mut self.frames.buf;
        if buf.len() < batch_meta_len(MAX_BATCH_PAGES) {
            buf.resize(batch_meta_len(MAX_BATCH_PAGES), 0);
        }
        read_exact(&mut self.inner, &mut buf[..8.min(head.len)], "record body")?;
        let count = self.batch_count(seq, head.flags, head.len, &self.frames.buf[..8])?;
        let meta_len = batch_meta_len(count);
        let buf = &mut self.frames.buf;
        read_exact(&mut self.inner, &mut buf[8..meta_len], "record body")?;
        Self::load_gfns(&mut self.gfns, &self.gfn_map, seq, &buf[8..meta_len])?;
        let runs: Vec<(u64, usize)> = gfn_runs(&self.gfns).collect();
        let mut h = crc32fast::Hasher::new();
        h.update(&head.hdr);
        h.update(&buf[..meta_len]);
        let mut bufs = placer.buffers(&runs).map_err(Error::Placement)?;
        if bufs.len() != runs.len() || bufs.iter().zip(&runs).any(|(b, r)| b.len() != r.1 * PAGE) {
            return Err(Error::Placement(format!("the placer's buffers do not match the batch's {} runs", runs.len())));
        }
        {
            // Reborrowed, so the buffers can be read again for the CRC once they are full.
            let mut work: Vec<io::IoSliceMut<'_>> = bufs.iter_mut().map(|b| io::IoSliceMut::new(&mut b[..])).collect();
            read_exact_vectored(&mut self.inner, &mut work, "record body")?;
        }
        if head.flags & FLAG_DATA_UNCHECKED == 0 {
            for b in &bufs {
                h.update(b);
            }
        }
        drop(bufs);
        let mut trailer = [0u8; TRAILER_LEN];
        read_exact(&mut self.inner, &mut trailer, "record body")?;
        self.frames.finish(&head.hdr, head.tag, h.finalize(), le_u32(&trailer))?;
        Ok(self.commit_batch(seq, head.flags, count, meta_len, true))
    }

    /// Reads and checks the next record, updating the grammar state.
    fn advance(&mut self, placer: Option<&mut dyn PagePlacer>) -> Result<Parsed> {
        let seq = self.frames.seq;
        let Some(head) = self.frames.read_head(&mut self.inner, false)? else {
            return Err(Error::Truncated { what: "stream (it ended before Complete or Abort)" });
        };
        if let (Tag::MemBatch, Some(p)) = (head.tag, placer) {
            return self.place_batch(&head, p);
        }
        let Frame { tag, flags, len } = self.frames.read_body(&mut self.inner, &head)?;
        let body = &self.frames.buf[..len];
        let bad = |reason: String| Err(Error::BadRecord { seq, reason });
        match tag {
            Tag::MemBatch => {
                let count = self.batch_count(seq, flags, len, &body[..8.min(len)])?;
                Self::load_gfns(&mut self.gfns, &self.gfn_map, seq, &body[8..batch_meta_len(count)])?;
                Ok(self.commit_batch(seq, flags, count, len, false))
            }
            Tag::ZeroPages => {
                let pages = Self::load_zero_runs(&mut self.zero_runs, &self.gfn_map, seq, self.round, body)?;
                // Each record's pages are bounded by the described memory; many cannot wrap.
                self.round_pages = self.round_pages.saturating_add(pages);
                Ok(Parsed::ZeroPages { round: self.round })
            }
            Tag::RoundEnd => {
                if len != 12 {
                    return bad(format!("RoundEnd body of {len} bytes (need 12)"));
                }
                let (round, pages) = (le_u32(&body[0..4]), le_u64(&body[4..12]));
                if round != self.round || pages != self.round_pages {
                    return bad(format!(
                        "RoundEnd for round {round} with {pages} pages, but round {} carried {} pages",
                        self.round, self.round_pages
                    ));
                }
                let Some(next) = self.round.checked_add(1) else {
                    return bad("too many rounds".into());
                };
                self.round = next;
                self.total_pages = self.total_pages.saturating_add(pages);
                self.last_round_unchecked = self.round_unchecked;
                self.round_pages = 0;
                self.round_unchecked = false;
                Ok(Parsed::RoundEnd { round, pages })
            }
            Tag::State => {
                if !self.expect_state {
                    return bad("State on an extra connection".into());
                }
                if self.state_seen {
                    return bad("a second State record".into());
                }
                self.state_seen = true;
                Ok(Parsed::State { len })
            }
            Tag::Complete => {
                if len != 8 {
                    return bad(format!("Complete body of {len} bytes (need 8)"));
                }
                let total_pages = le_u64(body);
                if self.expect_state && !self.state_seen {
                    return bad("Complete before State".into());
                }
                if self.round_pages != 0 {
                    return bad(format!("Complete inside round {} (no RoundEnd)", self.round));
                }
                if total_pages != self.total_pages {
                    return bad(format!(
                        "Complete claims {total_pages} pages, the rounds carried {}",
                        self.total_pages
                    ));
                }
                if self.last_round_unchecked {
                    return bad("the final round carried unchecked page data".into());
                }
                self.finished = true;
                Ok(Parsed::Complete { total_pages })
            }
            Tag::Abort => {
                if std::str::from_utf8(body).is_err() {
                    return bad("Abort reason is not UTF-8".into());
                }
                self.finished = true;
                Ok(Parsed::Abort { len })
            }
            // FrameReader already rejects replies in a record stream.
            Tag::Ready | Tag::Resumed | Tag::Failed | Tag::Placed | Tag::Accepted => Err(Error::UnknownTag(tag as u8)),
        }
    }

    /// The seq of the next record.
    pub fn seq(&self) -> u64 {
        self.frames.seq
    }

    /// The current round (the one the next batch belongs to).
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Whether `Complete` or `Abort` has been read.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The underlying reader.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The underlying reader, mutably.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Unwraps the reader.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// A receiver → sender reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The header was read and is valid; the destination builds the VM (Ready or Failed
    /// follows).
    Accepted,
    /// The destination's VM is built; the sender may send records.
    Ready,
    /// The destination runs the VM; the source may discard it.
    Resumed,
    /// The destination failed; the source keeps (and resumes) the VM.
    Failed(String),
    /// The batch with this seq (sent with [`FLAG_ACK`]) is in the destination's guest memory.
    Placed(u64),
}

/// Reads replies (sender side). Grammar: optionally `Accepted` first; then `Ready` or `Failed`;
/// after `Ready`, any
/// number of `Placed` (for increasing batch seqs), then `Resumed` or `Failed`; nothing after
/// `Resumed` or `Failed`.
#[derive(Debug)]
pub struct ReplyReader<R> {
    inner: R,
    frames: FrameReader,
    ready: bool,
    accepted: bool,
    finished: bool,
    last_placed: Option<u64>,
}

impl<R: Read> ReplyReader<R> {
    /// A reader for the replies on `inner`.
    pub fn new(inner: R) -> Self {
        ReplyReader {
            inner,
            frames: FrameReader::default(),
            ready: false,
            accepted: false,
            finished: false,
            last_placed: None,
        }
    }

    /// Waits for the next reply. EOF is [`Error::Truncated`]: the receiver must answer.
    pub fn next_reply(&mut self) -> Result<Reply> {
        let seq = self.frames.seq;
        if self.finished {
            return Err(Error::BadRecord { seq, reason: "no reply follows Resumed or Failed".into() });
        }
        let Some(Frame { tag, len, .. }) = self.frames.read(&mut self.inner, true)? else {
            return Err(Error::Truncated { what: "reply stream" });
        };
        let reply = match tag {
            Tag::Accepted if !self.ready && !self.accepted => {
                self.accepted = true;
                return Ok(Reply::Accepted);
            }
            Tag::Ready if !self.ready => Reply::Ready,
            Tag::Resumed if self.ready => Reply::Resumed,
            Tag::Placed if self.ready && len == 8 => {
                let placed = le_u64(&self.frames.buf[..8]);
                if self.last_placed.is_some_and(|l| placed <= l) {
                    self.frames.failed = true;
                    return Err(Error::BadRecord {
                        seq,
                        reason: format!("Placed for batch {placed} after a later one"),
                    });
                }
                self.last_placed = Some(placed);
                Reply::Placed(placed)
            }
            Tag::Failed => match std::str::from_utf8(&self.frames.buf[..len]) {
                Ok(s) => Reply::Failed(s.to_string()),
                Err(_) => {
                    self.frames.failed = true;
                    return Err(Error::BadRecord { seq, reason: "Failed reason is not UTF-8".into() });
                }
            },
            _ => {
                self.frames.failed = true;
                return Err(Error::BadRecord { seq, reason: format!("unexpected reply {tag}") });
            }
        };
        self.ready = true;
        self.finished = matches!(reply, Reply::Resumed | Reply::Failed(_));
        Ok(reply)
    }

    /// The underlying reader.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Unwraps the reader.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

#[cfg(test)]
mod tests;
