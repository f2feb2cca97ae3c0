use super::*;

/// 32 pages in two regions with a hole: gfns 0..16 and 256..272.
fn desc() -> VmDescription {
    VmDescription::new(
        2,
        Irqchip::Kernel,
        PayloadDescription::guest("memtouch"),
        vec![(0, 16 * 4096), (0x10_0000, 16 * 4096)],
    )
}

fn page(gfn: u64, round: u32) -> Vec<u8> {
    (0..PAGE).map(|i| (gfn as usize).wrapping_mul(7).wrapping_add(i * 13 + round as usize * 29) as u8).collect()
}

fn pages(gfns: &[u64], round: u32) -> Vec<u8> {
    gfns.iter().flat_map(|&g| page(g, round)).collect()
}

/// A record with its data copied out of the reader.
#[derive(Debug, Clone, PartialEq)]
enum Owned {
    Batch { round: u32, gfns: Vec<u64>, data: Vec<u8>, checked: bool },
    Zero(u32, Vec<(u64, u64)>),
    RoundEnd(u32, u64),
    State(Vec<u8>),
    Complete(u64),
    Abort(String),
}

fn own(r: Record<'_>) -> Owned {
    match r {
        Record::MemBatch(b) => {
            Owned::Batch { round: b.round, gfns: b.gfns.to_vec(), data: b.data.to_vec(), checked: b.checked }
        }
        Record::ZeroPages { round, runs } => Owned::Zero(round, runs.to_vec()),
        Record::RoundEnd { round, pages } => Owned::RoundEnd(round, pages),
        Record::State(s) => Owned::State(s.to_vec()),
        Record::Complete { total_pages } => Owned::Complete(total_pages),
        Record::Abort(r) => Owned::Abort(r.to_string()),
    }
}

fn read_all(bytes: &[u8]) -> Result<(VmDescription, Vec<Owned>)> {
    let (mut rd, desc) = Reader::open(bytes)?;
    let mut out = Vec::new();
    while let Some(r) = rd.next_record()? {
        out.push(own(r));
    }
    assert!(rd.is_finished());
    Ok((desc, out))
}

/// Two live rounds (batches with `live` coverage), a checked final round, State, Complete.
fn sample_stream(live: Checksum) -> (Vec<u8>, Vec<Owned>) {
    build_stream(&[
        (&[&[0, 1, 2, 3, 4, 5, 6, 7], &[256, 257, 258, 259]], live),
        (&[&[3, 257]], live),
        (&[&[271]], Checksum::Full),
    ])
}

/// Every record kind in as few bytes as possible, for the quadratic tests (truncate or
/// corrupt at every offset).
fn tiny_stream() -> Vec<u8> {
    build_stream(&[(&[&[0]], Checksum::Full), (&[&[256]], Checksum::Full)]).0
}

fn build_stream(rounds: &[(&[&[u64]], Checksum)]) -> (Vec<u8>, Vec<Owned>) {
    let mut w = Writer::start(Vec::new(), &desc()).unwrap();
    let mut expect = Vec::new();
    let mut total = 0;
    for (round, (batches, checksum)) in rounds.iter().enumerate() {
        let round = round as u32;
        let mut n = 0;
        for gfns in batches.iter() {
            let data = pages(gfns, round);
            let slices: Vec<&[u8]> = data.chunks(PAGE).collect();
            w.mem_batch_vectored(round, gfns, &slices, *checksum).unwrap();
            expect.push(Owned::Batch { round, gfns: gfns.to_vec(), data, checked: *checksum == Checksum::Full });
            n += gfns.len() as u64;
        }
        w.round_end(round, n).unwrap();
        expect.push(Owned::RoundEnd(round, n));
        total += n;
    }
    w.state(b"vcpu and irqchip state").unwrap();
    expect.push(Owned::State(b"vcpu and irqchip state".to_vec()));
    w.complete(total).unwrap();
    expect.push(Owned::Complete(total));
    (w.into_inner(), expect)
}

fn header_len(bytes: &[u8]) -> usize {
    HEADER_FIXED_LEN + le_u32(&bytes[12..16]) as usize + TRAILER_LEN
}

/// Header bytes for arbitrary JSON, with a valid CRC.
fn raw_header(version: u32, json: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(json);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A frame with any fields and a valid CRC over header and body.
fn raw_frame(tag: u8, flags: u8, seq: u64, body: &[u8]) -> Vec<u8> {
    let mut out = vec![tag, flags, 0, 0];
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn with_header(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = encode_header(&desc()).unwrap();
    for f in frames {
        out.extend_from_slice(f);
    }
    out
}

fn first_error(bytes: &[u8]) -> Error {
    read_all(bytes).expect_err("stream should be rejected")
}

use crate::TestRng as Rng;

// --- round trips and layout ---------------------------------------------------------------

#[test]
fn header_round_trip_and_layout() {
    let d = desc();
    let mut w = Vec::new();
    write_header(&mut w, &d).unwrap();
    assert_eq!(w, encode_header(&d).unwrap());
    assert_eq!(&w[..8], b"KUMOMIG\0");
    assert_eq!(le_u32(&w[8..12]), VERSION);
    let n = le_u32(&w[12..16]) as usize;
    assert_eq!(w.len(), 16 + n + 4);
    let json: serde_json::Value = serde_json::from_slice(&w[16..16 + n]).unwrap();
    assert_eq!(json["page_size"], 4096);
    assert_eq!(json["regions"][1], serde_json::json!([0x10_0000, 65536]));
    assert_eq!(le_u32(&w[16 + n..]), crc32fast::hash(&w[..16 + n]));
    assert_eq!(read_header(&mut w.as_slice()).unwrap(), d);
    assert_eq!(d.total_pages(), 32);
    assert!(d.contains_gfn(15) && d.contains_gfn(256) && d.contains_gfn(271));
    assert!(!d.contains_gfn(16) && !d.contains_gfn(255) && !d.contains_gfn(272));
}

#[test]
fn frame_layout() {
    // The CRC is CRC-32/ISO-HDLC (zlib's), as the format document says.
    assert_eq!(crc32fast::hash(b"123456789"), 0xcbf4_3926);
    let mut out = Vec::new();
    let mut e = Encoder::new();
    e.complete(&mut out, 1);
    out.clear();
    e.round_end(&mut out, 7, 0x0102_0304_0506);
    assert_eq!(out.len(), 16 + 12 + 4);
    assert_eq!(&out[..8], &[2, 0, 0, 0, 12, 0, 0, 0]);
    assert_eq!(le_u64(&out[8..16]), 1, "second frame of the encoder");
    assert_eq!(le_u32(&out[16..20]), 7);
    assert_eq!(le_u64(&out[20..28]), 0x0102_0304_0506);
    assert_eq!(le_u32(&out[28..]), crc32fast::hash(&out[..28]));
    // MemBatch: round, count, gfns, then the pages.
    out.clear();
    e.mem_batch(&mut out, 3, &[5, 9], &pages(&[5, 9], 3)).unwrap();
    assert_eq!(out.len(), 16 + batch_body_len(2) + 4);
    assert_eq!((out[0], out[1], le_u32(&out[4..8]) as usize), (1, 0, batch_body_len(2)));
    assert_eq!((le_u32(&out[16..20]), le_u32(&out[20..24])), (3, 2));
    assert_eq!((le_u64(&out[24..32]), le_u64(&out[32..40])), (5, 9));
    assert_eq!(&out[40..40 + PAGE], page(5, 3).as_slice());
    assert_eq!(MAX_BATCH_BODY, 4_202_504);
}

#[test]
fn every_record_kind_round_trips() {
    for live in [Checksum::Full, Checksum::MetadataOnly] {
        let (bytes, expect) = sample_stream(live);
        let (d, got) = read_all(&bytes).unwrap();
        assert_eq!(d, desc());
        assert_eq!(got, expect);
    }
    // Abort ends a stream anywhere, even mid-round.
    let mut w = Writer::start(Vec::new(), &desc()).unwrap();
    w.mem_batch(0, &[1], &page(1, 0)).unwrap();
    w.abort("source VM failed: ü").unwrap();
    let (_, got) = read_all(&w.into_inner()).unwrap();
    assert_eq!(got[1], Owned::Abort("source VM failed: ü".into()));
    // Empty state and a maximum batch.
    let gfns: Vec<u64> = (0..MAX_BATCH_PAGES as u64).collect();
    let big = VmDescription::new(
        1,
        Irqchip::Split,
        PayloadDescription::guest("memtouch"),
        vec![(0, MAX_BATCH_PAGES as u64 * 4096)],
    );
    let mut w = Writer::start(Vec::new(), &big).unwrap();
    let data = pages(&gfns, 0);
    w.mem_batch(0, &gfns, &data).unwrap();
    w.round_end(0, 1024).unwrap();
    w.state(&[]).unwrap();
    w.complete(1024).unwrap();
    let (_, got) = read_all(&w.into_inner()).unwrap();
    assert_eq!(got[0], Owned::Batch { round: 0, gfns, data, checked: true });
    assert_eq!(got[2], Owned::State(vec![]));
}

#[test]
fn batch_pages_iterator() {
    let (bytes, _) = sample_stream(Checksum::Full);
    let (mut rd, _) = Reader::open(bytes.as_slice()).unwrap();
    let Some(Record::MemBatch(b)) = rd.next_record().unwrap() else { panic!() };
    let v: Vec<(u64, Vec<u8>)> = b.pages().map(|(g, p)| (g, p.to_vec())).collect();
    assert_eq!(v.len(), 8);
    assert_eq!(v[3], (3, page(3, 0)));
    assert_eq!((rd.seq(), rd.round()), (1, 0));
}

#[test]
fn replies_round_trip() {
    let mut w = Writer::new(Vec::new());
    w.reply(&Reply::Ready).unwrap();
    w.reply(&Reply::Resumed).unwrap();
    let bytes = w.into_inner();
    assert_eq!(&bytes[..2], &[0x81, 0]);
    let mut r = ReplyReader::new(bytes.as_slice());
    assert_eq!(r.next_reply().unwrap(), Reply::Ready);
    assert_eq!(r.next_reply().unwrap(), Reply::Resumed);
    assert!(matches!(r.next_reply(), Err(Error::BadRecord { .. })));

    for first in [true, false] {
        let mut w = Writer::new(Vec::new());
        if first {
            w.reply(&Reply::Ready).unwrap();
        }
        w.reply(&Reply::Failed("no memory".into())).unwrap();
        let bytes = w.into_inner();
        let mut r = ReplyReader::new(bytes.as_slice());
        if first {
            assert_eq!(r.next_reply().unwrap(), Reply::Ready);
        }
        assert_eq!(r.next_reply().unwrap(), Reply::Failed("no memory".into()));
    }
    // Resumed before Ready, EOF, and a record tag among replies.
    let mut w = Writer::new(Vec::new());
    w.reply(&Reply::Resumed).unwrap();
    assert!(matches!(ReplyReader::new(w.into_inner().as_slice()).next_reply(), Err(Error::BadRecord { .. })));
    assert!(matches!(ReplyReader::new(&[][..]).next_reply(), Err(Error::Truncated { .. })));
    let f = raw_frame(Tag::Complete as u8, 0, 0, &0u64.to_le_bytes());
    assert!(matches!(ReplyReader::new(f.as_slice()).next_reply(), Err(Error::UnknownTag(4))));
}

#[test]
fn long_reasons_are_cut_at_a_char_boundary() {
    let mut out = Vec::new();
    let reason = "é".repeat(MAX_REASON_LEN); // 2 bytes each
    Encoder::new().abort(&mut out, &reason);
    assert_eq!(le_u32(&out[4..8]) as usize, MAX_REASON_LEN);
    let mut bytes = encode_header(&desc()).unwrap();
    bytes.extend_from_slice(&out);
    let (_, got) = read_all(&bytes).unwrap();
    assert_eq!(got, vec![Owned::Abort("é".repeat(MAX_REASON_LEN / 2))]);
}

// --- zero copy ------------------------------------------------------------------------------

#[test]
fn zero_copy_frames_match_the_buffered_encoder() {
    let gfns = [4u64, 9, 256];
    let data = pages(&gfns, 2);
    let mut buffered = Vec::new();
    let mut e = Encoder::new();
    e.round_end(&mut buffered, 0, 0); // the seq advances the same way in both
    e.mem_batch(&mut buffered, 2, &gfns, &data).unwrap();

    // Checked zero copy: head, then pages from "guest memory" fed one by one, then trailer.
    let assemble = |checksum| {
        let mut e = Encoder::new();
        let mut out = Vec::new();
        e.round_end(&mut out, 0, 0);
        let mut f = e.batch_frame(2, &gfns, checksum, false).unwrap();
        assert_eq!((f.seq(), f.data_len(), f.checksum()), (1, 3 * PAGE, checksum));
        for p in data.chunks(PAGE) {
            f.update(p);
        }
        out.extend_from_slice(f.head());
        out.extend_from_slice(&data);
        out.extend_from_slice(&f.trailer().unwrap());
        assert_eq!(e.seq(), 2);
        (out, f)
    };
    let (full, _) = assemble(Checksum::Full);
    assert_eq!(full, buffered);

    // Unchecked: only the flag byte and the CRC differ; the CRC covers the head alone.
    let (unchecked, f) = assemble(Checksum::MetadataOnly);
    assert_eq!(unchecked.len(), buffered.len());
    let frame_start = 16 + 12 + 4;
    let diff: Vec<usize> = (0..buffered.len()).filter(|&i| buffered[i] != unchecked[i]).collect();
    assert_eq!(diff[0], frame_start + 1);
    assert_eq!(unchecked[frame_start + 1], FLAG_DATA_UNCHECKED);
    assert!(diff[1..].iter().all(|&i| i >= buffered.len() - 4));
    assert_eq!(f.head(), &unchecked[frame_start..frame_start + 16 + batch_meta_len(3)]);
    assert_eq!(f.trailer().unwrap(), crc32fast::hash(f.head()).to_le_bytes());

    // The Writer's vectored path writes the same bytes.
    let mut w = Writer::new(Vec::new());
    w.round_end(0, 0).unwrap();
    let slices: Vec<&[u8]> = data.chunks(PAGE).collect();
    w.mem_batch_vectored(2, &gfns, &slices, Checksum::Full).unwrap();
    assert_eq!(w.get_ref(), &buffered);
}

#[test]
fn encoder_rejects_bad_batches_without_using_a_seq() {
    let mut e = Encoder::new();
    let mut out = Vec::new();
    assert!(matches!(e.mem_batch(&mut out, 0, &[1, 2], &[0; PAGE]), Err(Error::BadRecord { seq: 0, .. })));
    assert!(matches!(e.batch_frame(0, &[], Checksum::Full, false), Err(Error::BadRecord { .. })));
    let many = vec![0u64; MAX_BATCH_PAGES + 1];
    assert!(matches!(
        e.batch_frame(0, &many, Checksum::Full, false),
        Err(Error::Oversized { len: 1025, max: 1024, .. })
    ));
    let mut f = e.batch_frame(0, &[1], Checksum::Full, false).unwrap();
    f.update(&[0; 100]);
    assert!(matches!(f.trailer(), Err(Error::BadRecord { .. })));
    assert_eq!(e.seq(), 1);
    assert!(out.is_empty());
    let huge = vec![0u8; MAX_STATE_LEN + 1];
    assert!(matches!(e.state(&mut out, &huge), Err(Error::Oversized { .. })));
    assert!(matches!(Writer::new(Vec::new()).state(&huge), Err(Error::Oversized { .. })));
}

#[test]
fn unchecked_data_is_the_documented_exception() {
    let (bytes, _) = sample_stream(Checksum::MetadataOnly);
    let h = header_len(&bytes);
    // First page byte of the first (unchecked) batch: not detected.
    let data_at = h + 16 + batch_meta_len(8);
    let mut b = bytes.clone();
    b[data_at] ^= 0xff;
    let (_, got) = read_all(&b).unwrap();
    let Owned::Batch { data, checked: false, .. } = &got[0] else { panic!() };
    assert_eq!(data[0], page(0, 0)[0] ^ 0xff);
    // Its gfns are covered.
    let mut b = bytes.clone();
    b[h + 16 + 8] ^= 1;
    assert!(matches!(first_error(&b), Error::ChecksumMismatch { seq: 0, tag: Tag::MemBatch }));
    // The same flip in a checked stream is caught.
    let (bytes, _) = sample_stream(Checksum::Full);
    let mut b = bytes.clone();
    b[data_at] ^= 0xff;
    assert!(matches!(first_error(&b), Error::ChecksumMismatch { seq: 0, tag: Tag::MemBatch }));
}

#[test]
fn the_final_round_must_be_checked() {
    let mut w = Writer::start(Vec::new(), &desc()).unwrap();
    w.mem_batch_vectored(0, &[1], &[&page(1, 0)], Checksum::MetadataOnly).unwrap();
    w.round_end(0, 1).unwrap();
    w.state(b"s").unwrap();
    w.complete(1).unwrap();
    let e = first_error(&w.into_inner());
    assert!(matches!(&e, Error::BadRecord { seq: 3, reason } if reason.contains("unchecked")), "{e}");
}

// --- errors from crafted input --------------------------------------------------------------

#[test]
fn header_errors() {
    let good = encode_header(&desc()).unwrap();
    let read = |b: &[u8]| read_header(&mut &b[..]).unwrap_err();

    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(read(&b), Error::BadMagic { .. }));
    assert!(matches!(read(b"GET / HTTP/1.1\r\n"), Error::BadMagic { .. }));
    assert!(matches!(read(b"KUMO"), Error::Truncated { what: "stream header" }));
    assert!(matches!(read(b"KUMX"), Error::BadMagic { .. }));
    assert!(matches!(read(b""), Error::Truncated { .. }));

    // Version is checked before the description is even read.
    let mut b = good.clone();
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(read(&b[..16]), Error::UnsupportedVersion { got: 1, supported: VERSION }));
    assert!(matches!(read(&raw_header(0, b"{}")), Error::UnsupportedVersion { got: 0, .. }));

    let mut b = good[..16].to_vec();
    b[12..16].copy_from_slice(&(MAX_DESC_LEN as u32 + 1).to_le_bytes());
    assert!(matches!(read(&b), Error::Oversized { len: 1_048_577, max: 1_048_576, .. }));

    let mut b = good.clone();
    let last = b.len() - 1;
    b[last] ^= 1;
    assert!(matches!(read(&b), Error::HeaderChecksumMismatch));

    let bad_desc = |json: serde_json::Value| read(&raw_header(VERSION, json.to_string().as_bytes()));
    let mut j = serde_json::to_value(desc()).unwrap();
    assert!(matches!(read(&raw_header(VERSION, b"{not json")), Error::BadDescription(_)));
    j["page_size"] = 8192.into();
    assert!(matches!(bad_desc(j.clone()), Error::BadDescription(m) if m.contains("page size")));
    j["page_size"] = 4096.into();
    j["memory_bytes"] = (33 * 4096).into();
    assert!(matches!(bad_desc(j.clone()), Error::BadDescription(m) if m.contains("cover")));
    j["memory_bytes"] = (32 * 4096).into();
    j["regions"] = serde_json::json!([[0, 65536], [4096, 65536]]);
    assert!(matches!(bad_desc(j.clone()), Error::BadDescription(m) if m.contains("overlap")));
    j["regions"] = serde_json::json!([[0, 131072]]);
    assert_eq!(
        read_header(&mut raw_header(VERSION, j.to_string().as_bytes()).as_slice()).unwrap().regions,
        vec![(0, 131072)]
    );
    j["extra"] = 1.into();
    assert!(matches!(bad_desc(j.clone()), Error::BadDescription(m) if m.contains("extra")));
}

#[test]
fn descriptions_are_validated_before_writing() {
    let mut d = desc();
    d.page_size = 2 << 20;
    assert!(matches!(write_header(&mut Vec::new(), &d), Err(Error::BadDescription(_))));
    for regions in [vec![], vec![(0, 100)], vec![(1, 4096)], vec![(u64::MAX - 4095, 8192)]] {
        let d = VmDescription::new(1, Irqchip::Kernel, PayloadDescription::guest("memtouch"), regions);
        assert!(matches!(d.validate(), Err(Error::BadDescription(_))), "{d:?}");
    }
    let mut d = desc();
    d.cpus = 0;
    assert!(matches!(Writer::start(Vec::new(), &d), Err(Error::BadDescription(_))));
}

/// Headers a receiver must refuse before it builds anything: none can make it allocate in
/// proportion to what they describe.
#[test]
fn absurd_descriptions_are_refused() {
    let with = |cpus: u32, regions: Vec<(u64, u64)>| {
        VmDescription::new(cpus, Irqchip::Kernel, PayloadDescription::guest("memtouch"), regions)
    };
    let bad = [
        (with(1, vec![(0, MAX_GPA + 4096)]), "52-bit"),
        (with(1, vec![(0, 1 << 30), (MAX_GPA - 4096, 8192)]), "52-bit"),
        (with(1, vec![(1 << 60, 4096)]), "52-bit"),
        (with(1, vec![(4096, !4095u64)]), "wraps around"),
        (with(1, (0..65).map(|i| (i << 20, 4096)).collect()), "65 memory regions"),
        (with(MAX_CPUS + 1, vec![(0, 1 << 20)]), "4097 vCPUs"),
        (with(u32::MAX, vec![(0, 1 << 20)]), "vCPUs"),
    ];
    for (d, want) in bad {
        match d.validate() {
            Err(Error::BadDescription(m)) => assert!(m.contains(want), "want `{want}` in `{m}`"),
            other => panic!("{:?} regions, {} cpus: {other:?}", d.regions.len(), d.cpus),
        }
    }
    // The same refusals on the wire: a raw header carrying them fails read_header.
    let mut j = serde_json::to_value(desc()).unwrap();
    j["regions"] = serde_json::json!([[4096, MAX_GPA]]);
    j["memory_bytes"] = MAX_GPA.into();
    let e = read_header(&mut raw_header(VERSION, j.to_string().as_bytes()).as_slice()).unwrap_err();
    assert!(matches!(&e, Error::BadDescription(m) if m.contains("52-bit")), "{e}");
    // memory_bytes that the regions do not add up to, however large.
    j["regions"] = serde_json::json!([[0, 1 << 20]]);
    j["memory_bytes"] = u64::MAX.into();
    let e = read_header(&mut raw_header(VERSION, j.to_string().as_bytes()).as_slice()).unwrap_err();
    assert!(matches!(&e, Error::BadDescription(m) if m.contains("cover")), "{e}");
    // Huge but addressable shapes pass the format: the receiver's own host check refuses them.
    with(MAX_CPUS, vec![(0, 3 << 30), (4 << 30, (1 << 50) - (3 << 30))]).validate().unwrap();
    with(1, vec![(0, MAX_GPA)]).validate().unwrap();
    with(1, (0..MAX_REGIONS as u64).map(|i| (i << 20, 4096)).collect()).validate().unwrap();
}

#[test]
fn record_errors() {
    let batch = |round: u32, gfns: &[u64]| {
        let mut b = round.to_le_bytes().to_vec();
        b.extend_from_slice(&(gfns.len() as u32).to_le_bytes());
        gfns.iter().for_each(|g| b.extend_from_slice(&g.to_le_bytes()));
        b.extend_from_slice(&pages(gfns, round));
        b
    };
    let end = |round: u32, pages: u64| [round.to_le_bytes().to_vec(), pages.to_le_bytes().to_vec()].concat();
    let err = |frames: &[Vec<u8>]| first_error(&with_header(frames));

    // ChecksumMismatch names the record.
    let mut f = raw_frame(2, 0, 1, &end(0, 1));
    f[20] ^= 1;
    assert!(matches!(
        err(&[raw_frame(1, 0, 0, &batch(0, &[1])), f]),
        Error::ChecksumMismatch { seq: 1, tag: Tag::RoundEnd }
    ));

    // A valid frame with the wrong seq: lost or repeated record.
    assert!(matches!(
        err(&[raw_frame(1, 0, 0, &batch(0, &[1])), raw_frame(1, 0, 0, &batch(0, &[2]))]),
        Error::BadSequence { expected: 1, got: 0 }
    ));
    assert!(matches!(err(&[raw_frame(2, 0, 5, &end(0, 0))]), Error::BadSequence { expected: 0, got: 5 }));

    // Tags: unknown, and replies in a record stream.
    assert!(matches!(err(&[raw_frame(9, 0, 0, b"")]), Error::UnknownTag(9)));
    assert!(matches!(err(&[raw_frame(0x81, 0, 0, b"")]), Error::UnknownTag(0x81)));
    assert!(matches!(err(&[raw_frame(0, 0, 0, b"")]), Error::UnknownTag(0)));

    // Oversized lengths are refused before anything is read or allocated.
    let mut hdr = raw_frame(3, 0, 0, b"")[..16].to_vec();
    hdr[4..8].copy_from_slice(&(MAX_STATE_LEN as u32 + 1).to_le_bytes());
    assert!(matches!(err(&[hdr]), Error::Oversized { what: "record body", max, .. } if max == MAX_STATE_LEN as u64));
    let mut hdr = raw_frame(1, 0, 0, b"")[..16].to_vec();
    hdr[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(err(&[hdr]), Error::Oversized { .. }));
    let mut b = batch(0, &[1]);
    b[4..8].copy_from_slice(&5000u32.to_le_bytes());
    assert!(matches!(err(&[raw_frame(1, 0, 0, &b)]), Error::Oversized { what: "page batch", len: 5000, .. }));
    assert!(matches!(err(&[raw_frame(1, FLAG_DATA_UNCHECKED, 0, &b)]), Error::Oversized { what: "page batch", .. }));
    assert!(matches!(err(&[raw_frame(2, 0, 0, &[0; 13])]), Error::Oversized { .. }));

    // Pages outside memory: in the hole, past the end, and absurd.
    for gfn in [16, 255, 272, u64::MAX] {
        let e = err(&[raw_frame(1, 0, 0, &batch(0, &[1, gfn]))]);
        assert!(matches!(e, Error::PageOutOfRange { gfn: g, memory_bytes: 131072 } if g == gfn), "{e}");
    }

    // Malformed bodies and flags.
    let bad = |frames: &[Vec<u8>], what: &str| {
        let e = err(frames);
        assert!(matches!(&e, Error::BadRecord { reason, .. } if reason.contains(what)), "{what}: {e}");
    };
    bad(&[raw_frame(1, 0, 0, &batch(0, &[1])[..100])], "pages in a");
    bad(&[raw_frame(1, 0, 0, &batch(0, &[]))], "0 pages");
    bad(&[raw_frame(1, 0, 0, &[0; 4])], "shorter");
    bad(&[raw_frame(1, FLAG_DATA_UNCHECKED, 0, &[0; 4])], "shorter");
    bad(&[raw_frame(1, 4, 0, &batch(0, &[1]))], "flags");
    bad(&[raw_frame(2, FLAG_ACK, 0, &end(0, 0))], "flags");
    bad(&[raw_frame(1, 0, 0, &batch(0, &[5, 3]))], "out of order");
    bad(&[raw_frame(1, 0, 0, &batch(0, &[5, 5]))], "out of order");
    bad(&[raw_frame(2, FLAG_DATA_UNCHECKED, 0, &end(0, 0))], "flags");
    let mut f = raw_frame(4, 0, 0, &[0; 8]);
    f[2] = 1;
    let crc = crc32fast::hash(&f[..24]);
    f[24..].copy_from_slice(&crc.to_le_bytes());
    bad(&[f], "reserved");
    bad(&[raw_frame(2, 0, 0, &[0; 11])], "need 12");
    bad(&[raw_frame(5, 0, 0, &[0xff, 0xfe])], "UTF-8");

    // Grammar.
    let state = || raw_frame(3, 0, 2, b"s");
    bad(&[raw_frame(1, 0, 0, &batch(1, &[1]))], "round 1 during round 0");
    bad(&[raw_frame(1, 0, 0, &batch(0, &[1])), raw_frame(2, 0, 1, &end(0, 2))], "carried 1 pages");
    bad(&[raw_frame(2, 0, 0, &end(1, 0))], "round 0 carried");
    bad(&[raw_frame(2, 0, 0, &end(0, 0)), raw_frame(4, 0, 1, &0u64.to_le_bytes())], "before State");
    bad(&[raw_frame(2, 0, 0, &end(0, 0)), raw_frame(3, 0, 1, b""), raw_frame(3, 0, 2, b"")], "second State");
    bad(
        &[raw_frame(1, 0, 0, &batch(0, &[1])), raw_frame(3, 0, 1, b""), raw_frame(4, 0, 2, &1u64.to_le_bytes())],
        "no RoundEnd",
    );
    bad(
        &[
            raw_frame(1, 0, 0, &batch(0, &[1])),
            raw_frame(2, 0, 1, &end(0, 1)),
            state(),
            raw_frame(4, 0, 3, &2u64.to_le_bytes()),
        ],
        "claims 2",
    );
    bad(&[raw_frame(4, 0, 0, &[0; 7])], "need 8");
    // Rounds may be empty, and State may come before the final round.
    let ok = with_header(&[
        raw_frame(2, 0, 0, &end(0, 0)),
        raw_frame(3, 0, 1, b"s"),
        raw_frame(1, 0, 2, &batch(1, &[1])),
        raw_frame(2, 0, 3, &end(1, 1)),
        raw_frame(4, 0, 4, &1u64.to_le_bytes()),
    ]);
    assert_eq!(read_all(&ok).unwrap().1.len(), 5);
}

#[test]
fn reading_stops_after_complete_and_after_errors() {
    let (mut bytes, _) = sample_stream(Checksum::Full);
    bytes.extend_from_slice(b"the receiver never reads this");
    let (mut rd, _) = Reader::open(bytes.as_slice()).unwrap();
    while rd.next_record().unwrap().is_some() {}
    assert!(rd.next_record().unwrap().is_none());
    assert_eq!(rd.into_inner(), b"the receiver never reads this");

    let b = with_header(&[raw_frame(9, 0, 0, b""), raw_frame(5, 0, 0, b"x")]);
    let (mut rd, _) = Reader::open(b.as_slice()).unwrap();
    assert!(matches!(rd.next_record(), Err(Error::UnknownTag(9))));
    assert!(matches!(rd.next_record(), Err(Error::BadRecord { reason, .. }) if reason.contains("already failed")));
}

#[test]
fn io_errors_pass_through() {
    struct Failing;
    impl Read for Failing {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset"))
        }
    }
    assert!(matches!(read_header(&mut Failing), Err(Error::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset));
    assert!(matches!(Reader::new(Failing, &desc()).next_record(), Err(Error::Io(_))));
    // Interrupted reads are retried, one byte at a time here.
    struct Trickle<'a>(&'a [u8], bool);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.1 = !self.1;
            if self.1 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let n = buf.len().min(1).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let (bytes, expect) = sample_stream(Checksum::Full);
    let (mut rd, _) = Reader::open(Trickle(&bytes, false)).unwrap();
    let mut got = Vec::new();
    while let Some(r) = rd.next_record().unwrap() {
        got.push(own(r));
    }
    assert_eq!(got, expect);
}

#[test]
fn truncation_at_every_offset() {
    let bytes = tiny_stream();
    let h = header_len(&bytes);
    for cut in 0..bytes.len() {
        match read_all(&bytes[..cut]) {
            Err(Error::Truncated { what }) => {
                if cut < h {
                    assert_eq!(what, "stream header", "cut at {cut}");
                }
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    assert!(read_all(&bytes).is_ok());
}

#[test]
fn flipping_any_byte_is_detected() {
    let mut bytes = tiny_stream();
    assert!(read_all(&bytes).is_ok());
    for mask in [0x01u8, 0x80, 0xff] {
        for i in 0..bytes.len() {
            bytes[i] ^= mask;
            assert!(read_all(&bytes).is_err(), "flip {mask:#x} at {i} went unnoticed");
            bytes[i] ^= mask;
        }
    }
}

#[test]
fn fuzz_garbage_never_panics() {
    let (valid, _) = sample_stream(Checksum::MetadataOnly);
    let header = encode_header(&desc()).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for i in 0..4000 {
        let input: Vec<u8> = match i % 4 {
            // Pure garbage, sometimes with a valid magic.
            0 => {
                let mut v: Vec<u8> = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
                if rng.below(2) == 0 && v.len() >= 8 {
                    v[..8].copy_from_slice(&MAGIC);
                }
                v
            }
            // A valid header then garbage.
            1 => {
                let mut v = header.clone();
                v.extend((0..rng.below(400)).map(|_| rng.next() as u8));
                v
            }
            // A valid stream with a few random changes, cuts and insertions.
            2 => {
                let mut v = valid.clone();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(v.len());
                    match rng.below(3) {
                        0 => v[at] = rng.next() as u8,
                        1 => v.truncate(at),
                        _ => v.insert(at, rng.next() as u8),
                    }
                    if v.is_empty() {
                        break;
                    }
                }
                v
            }
            // Frames with valid CRC and seq but random contents: exercises the body parsers.
            _ => {
                let mut v = header.clone();
                for seq in 0..1 + rng.below(6) as u64 {
                    let tag = [1u8, 2, 3, 4, 5, 0x81, 7][rng.below(7)];
                    let flags = [0u8, 0, 1, 2][rng.below(4)];
                    let mut body: Vec<u8> = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
                    if tag == 1 && rng.below(2) == 0 {
                        let n = 1 + rng.below(3);
                        body = [0u32.to_le_bytes(), (n as u32).to_le_bytes()].concat();
                        for _ in 0..n {
                            let gfn = [rng.next() % 300, rng.next()][rng.below(2)];
                            body.extend_from_slice(&gfn.to_le_bytes());
                        }
                        body.resize(batch_body_len(n) - rng.below(2), 0);
                    }
                    v.extend(raw_frame(tag, flags, seq, &body));
                }
                v
            }
        };
        let _ = read_all(&input);
        let _ = ReplyReader::new(input.as_slice()).next_reply();
    }
}

#[test]
fn connections_and_shared_memory_round_trip_and_are_checked() {
    let mut d = desc();
    assert_eq!((d.connections, d.shared_memory), (1, false));
    d.connections = 3;
    d.shared_memory = true;
    let mut bytes = Vec::new();
    write_header(&mut bytes, &d).unwrap();
    assert_eq!(read_header(&mut &bytes[..]).unwrap(), d);
    // Older descriptions without the fields read as one connection, no shared memory.
    let json = serde_json::to_value(desc()).unwrap();
    let mut obj = json.as_object().unwrap().clone();
    obj.remove("connections");
    obj.remove("shared_memory");
    let old: VmDescription = serde_json::from_value(serde_json::Value::Object(obj)).unwrap();
    assert_eq!((old.connections, old.shared_memory), (1, false));
    for bad in [0, MAX_CONNECTIONS + 1] {
        let mut d = desc();
        d.connections = bad;
        assert!(matches!(d.validate(), Err(Error::BadDescription(m)) if m.contains("connections")));
    }
}

#[test]
fn an_extra_connection_carries_no_state() {
    let d = desc();
    let mut enc = Encoder::new();
    let mut out = Vec::new();
    enc.mem_batch(&mut out, 0, &[1], &page(1, 0)).unwrap();
    enc.round_end(&mut out, 0, 1);
    enc.complete(&mut out, 1);
    // Accepted by a secondary reader without State...
    let mut r = Reader::secondary(&out[..], &d);
    let mut n = 0;
    while r.next_record().unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 3);
    // ...rejected by a primary one, and State on a secondary connection is an error.
    let mut r = Reader::new(&out[..], &d);
    let e = loop {
        match r.next_record() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("Complete without State accepted"),
            Err(e) => break e,
        }
    };
    assert!(e.to_string().contains("before State"), "{e}");
    let mut enc = Encoder::new();
    let mut out = Vec::new();
    enc.state(&mut out, b"s").unwrap();
    let mut r = Reader::secondary(&out[..], &d);
    assert!(r.next_record().unwrap_err().to_string().contains("extra connection"));
}

// --- reading in place -----------------------------------------------------------------------

/// "Guest memory" for `desc()`: gfns 0..16 then 256..272, back to back.
struct VecPlacer {
    mem: Vec<u8>,
    calls: usize,
}

fn mem_offset(gfn: u64) -> usize {
    (if gfn < 16 { gfn } else { 16 + gfn - 256 }) as usize * PAGE
}

impl PagePlacer for VecPlacer {
    fn buffers(&mut self, runs: &[(u64, usize)]) -> std::result::Result<Vec<io::IoSliceMut<'_>>, String> {
        self.calls += 1;
        let mut rest: &mut [u8] = &mut self.mem;
        let mut base = 0;
        let mut out = Vec::new();
        for &(gfn, n) in runs {
            let off = mem_offset(gfn);
            let tail = std::mem::take(&mut rest);
            let (run, tail) =
                tail.split_at_mut(off.checked_sub(base).ok_or("runs out of order")?).1.split_at_mut(n * PAGE);
            out.push(io::IoSliceMut::new(run));
            rest = tail;
            base = off + n * PAGE;
        }
        Ok(out)
    }
}

/// Hands out at most `chunk` bytes per read, so vectored reads end mid-buffer.
struct Dribble<'a> {
    bytes: &'a [u8],
    chunk: usize,
}

impl Read for Dribble<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.chunk).min(self.bytes.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

/// A placed batch as (gfns, seq, ack).
type Placed = (Vec<u64>, u64, bool);

/// Reads a stream placing pages; returns the memory and the batches.
fn read_placed<R: Read>(inner: R) -> Result<(VecPlacer, Vec<Placed>)> {
    let (mut rd, _) = Reader::open(inner)?;
    let mut p = VecPlacer { mem: vec![0; 32 * PAGE], calls: 0 };
    let mut batches = Vec::new();
    while let Some(r) = rd.next_record_placed(&mut p)? {
        if let Record::MemBatch(b) = r {
            assert!(b.data.is_empty());
            batches.push((b.gfns.to_vec(), b.seq, b.ack));
        }
    }
    Ok((p, batches))
}

#[test]
fn placed_reading_puts_every_page_where_it_belongs() {
    for live in [Checksum::Full, Checksum::MetadataOnly] {
        let (bytes, expect) = sample_stream(live);
        let mut want = vec![0u8; 32 * PAGE];
        for e in &expect {
            if let Owned::Batch { gfns, data, .. } = e {
                for (g, d) in gfns.iter().zip(data.chunks(PAGE)) {
                    want[mem_offset(*g)..mem_offset(*g) + PAGE].copy_from_slice(d);
                }
            }
        }
        for chunk in [usize::MAX, 1000, 4096, 7] {
            let (p, batches) = read_placed(Dribble { bytes: &bytes, chunk }).unwrap();
            assert!(p.mem == want, "{live:?}, chunk {chunk}: memory differs");
            assert_eq!(batches.len(), 4);
            assert_eq!(batches[0].0, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        }
    }
}

#[test]
fn placed_reading_checks_like_buffered_reading() {
    // Corrupt page data: the CRC over the placed memory catches it.
    let (mut bytes, _) = sample_stream(Checksum::Full);
    let at = header_len(&bytes) + FRAME_HEADER_LEN + batch_meta_len(8) + 100;
    bytes[at] ^= 1;
    assert!(matches!(read_placed(&bytes[..]), Err(Error::ChecksumMismatch { seq: 0, tag: Tag::MemBatch })));
    // A page outside memory is refused before anything is placed.
    let body = [0u32.to_le_bytes(), 2u32.to_le_bytes()].concat();
    let body = [body, 1u64.to_le_bytes().to_vec(), 300u64.to_le_bytes().to_vec(), pages(&[1, 300], 0)].concat();
    let bytes = with_header(&[raw_frame(1, 0, 0, &body)]);
    let (mut rd, _) = Reader::open(&bytes[..]).unwrap();
    let mut p = VecPlacer { mem: vec![0; 32 * PAGE], calls: 0 };
    assert!(matches!(rd.next_record_placed(&mut p), Err(Error::PageOutOfRange { gfn: 300, .. })));
    assert_eq!(p.calls, 0);
    // Truncation anywhere.
    let bytes = tiny_stream();
    for cut in 0..bytes.len() {
        assert!(matches!(read_placed(&bytes[..cut]), Err(Error::Truncated { .. })), "cut at {cut}");
    }
    // A placer that cannot place fails the read with its reason.
    struct Refuse;
    impl PagePlacer for Refuse {
        fn buffers(&mut self, _: &[(u64, usize)]) -> std::result::Result<Vec<io::IoSliceMut<'_>>, String> {
            Err("no such memory".into())
        }
    }
    let (mut rd, _) = Reader::open(&bytes[..]).unwrap();
    assert!(matches!(rd.next_record_placed(&mut Refuse), Err(Error::Placement(m)) if m == "no such memory"));
}

#[test]
fn acknowledged_batches_carry_their_seq_and_only_on_the_first_connection() {
    let d = desc();
    let mut enc = Encoder::new();
    let mut out = encode_header(&d).unwrap();
    enc.round_end(&mut out, 0, 0);
    let data = pages(&[2, 3], 1);
    let mut f = enc.batch_frame(1, &[2, 3], Checksum::Full, true).unwrap();
    f.update(&data);
    out.extend_from_slice(f.head());
    out.extend_from_slice(&data);
    out.extend_from_slice(&f.trailer().unwrap());
    // (The stream ends here: the batches read before the truncation are what counts.)
    let (mut rd, _) = Reader::open(&out[..]).unwrap();
    let mut p = VecPlacer { mem: vec![0; 32 * PAGE], calls: 0 };
    rd.next_record_placed(&mut p).unwrap();
    let Some(Record::MemBatch(b)) = rd.next_record_placed(&mut p).unwrap() else { panic!("no batch") };
    assert_eq!((b.gfns, b.seq, b.ack, b.data.len()), (&[2u64, 3][..], 1, true, 0));
    assert!(p.mem[2 * PAGE..4 * PAGE] == data[..]);
    assert!(matches!(rd.next_record_placed(&mut p), Err(Error::Truncated { .. })));
    let (mut rd, _) = Reader::open(&out[..]).unwrap();
    rd.next_record().unwrap();
    let Some(Record::MemBatch(b)) = rd.next_record().unwrap() else { panic!("no batch") };
    assert_eq!((b.seq, b.ack, b.data.len()), (1, true, 2 * PAGE));
    // An extra connection has no reply channel of its own.
    let frames = &out[header_len(&out)..];
    let mut r = Reader::secondary(frames, &d);
    r.next_record().unwrap();
    assert!(r.next_record().unwrap_err().to_string().contains("extra connection"));
    // The encoder refuses out-of-order gfns, which would alias placed buffers.
    assert!(matches!(enc.batch_frame(1, &[3, 2], Checksum::Full, false), Err(Error::BadRecord { .. })));
}

/// `good` reads back reply by reply; each of `bad` fails with `BadRecord` at some reply.
fn check_reply_grammar(good: &[Reply], bad: &[Vec<Reply>]) {
    let encode = |replies: &[Reply]| {
        let mut w = Writer::new(Vec::new());
        for r in replies {
            w.reply(r).unwrap();
        }
        w.into_inner()
    };
    let bytes = encode(good);
    let mut r = ReplyReader::new(bytes.as_slice());
    for want in good {
        assert_eq!(&r.next_reply().unwrap(), want);
    }
    for b in bad {
        let bytes = encode(b);
        let mut r = ReplyReader::new(bytes.as_slice());
        let e = (0..b.len()).map(|_| r.next_reply()).find_map(|x| x.err());
        assert!(matches!(e, Some(Error::BadRecord { .. })), "{b:?}: {e:?}");
    }
}

#[test]
fn placed_replies_follow_ready_in_order() {
    check_reply_grammar(
        &[Reply::Ready, Reply::Placed(3), Reply::Placed(5), Reply::Resumed],
        &[vec![Reply::Placed(1)], vec![Reply::Ready, Reply::Placed(4), Reply::Placed(4)]],
    );
}

#[test]
fn contiguous_gfns_form_runs() {
    let r: Vec<_> = gfn_runs(&[4, 5, 6, 9, 11, 12]).collect();
    assert_eq!(r, vec![(4, 3), (9, 1), (11, 2)]);
    assert_eq!(gfn_runs(&[]).count(), 0);
}

#[test]
fn accepted_comes_first_and_once() {
    check_reply_grammar(
        &[Reply::Accepted, Reply::Ready, Reply::Resumed],
        &[vec![Reply::Accepted, Reply::Accepted], vec![Reply::Ready, Reply::Accepted]],
    );
}

/// A description with every field set survives the header; an unknown field anywhere in it is
/// refused (a newer sender's VM is not half-read); an older stream version is refused in one
/// line before its description is read.
#[test]
fn typed_descriptions_round_trip_and_refuse_what_they_do_not_know() {
    let mut d = VmDescription::new(
        2,
        Irqchip::User,
        PayloadDescription::Kernel {
            path: "/boot/vmlinuz".into(),
            initrd: Some("/boot/initrd".into()),
            cmdline: Some("console=ttyS0".into()),
        },
        vec![(0, 64 << 20)],
    );
    d.nets = vec![
        NicDescription {
            mac: "52:54:00:12:34:56".into(),
            queues: 2,
            irq: NicIrqPath::Dedicated { vcpu: 1 },
            source_backend: SourceBackend::Tap("tap0".into()),
            offload: false,
        },
        NicDescription {
            mac: "52:54:00:12:34:57".into(),
            queues: 1,
            irq: NicIrqPath::Shared,
            source_backend: SourceBackend::VhostUser("/run/nb.sock".into()),
            offload: true,
        },
    ];
    d.numa = Some(NumaDescription {
        nodes: vec![
            NumaNodeDescription { id: 0, cpus: vec![0], memory: 32 << 20 },
            NumaNodeDescription { id: 1, cpus: vec![1], memory: 32 << 20 },
        ],
        distances: vec![NumaDistanceDescription { src: 0, dst: 1, value: 21 }],
    });
    d.pv = PvDescription { steal_time: Some(true), pv_ipi: Some(false), ..Default::default() };
    let mut bytes = Vec::new();
    write_header(&mut bytes, &d).unwrap();
    assert_eq!(read_header(&mut &bytes[..]).unwrap(), d);
    let j = serde_json::to_value(&d).unwrap();
    assert_eq!(j["irqchip"], "user");
    assert_eq!(j["nets"][0]["irq"], serde_json::json!({"path": "dedicated", "vcpu": 1}));
    assert_eq!(j["nets"][1]["source_backend"], serde_json::json!({"vhost_user": "/run/nb.sock"}));
    // A plain description leaves the optional parts out.
    let plain = serde_json::to_value(desc()).unwrap();
    for k in ["nets", "numa", "pv"] {
        assert!(plain.get(k).is_none(), "{k} in {plain}");
    }
    let refused = |patch: &dyn Fn(&mut serde_json::Value), want: &str| {
        let mut v = j.clone();
        patch(&mut v);
        let e = read_header(&mut raw_header(VERSION, v.to_string().as_bytes()).as_slice()).unwrap_err();
        assert!(matches!(&e, Error::BadDescription(m) if m.contains(want)), "want `{want}` in `{e}`");
    };
    refused(&|v| v["pins"] = serde_json::json!([1, 2]), "unknown field `pins`");
    refused(&|v| v["payload"]["kernel"]["x"] = 1.into(), "unknown field `x`");
    refused(&|v| v["nets"][0]["tap"] = "t".into(), "unknown field `tap`");
    refused(&|v| v["nets"][0]["irq"]["x"] = 1.into(), "unknown field `x`");
    refused(&|v| v["numa"]["nodes"][0]["host_node"] = 1.into(), "unknown field `host_node`");
    refused(&|v| v["pv"]["x"] = true.into(), "unknown field `x`");
    refused(&|v| v["irqchip"] = "qemu".into(), "unknown variant `qemu`");
    refused(&|v| v["payload"] = serde_json::json!({"guest": "memtouch"}), "invalid type");
    // Version 4 carried an opaque config: refused by its version, in one line.
    let mut old = bytes.clone();
    old[8..12].copy_from_slice(&4u32.to_le_bytes());
    let e = read_header(&mut &old[..]).unwrap_err().to_string();
    assert_eq!(e, format!("unsupported migration stream version 4 (this kumo reads version {VERSION})"));
}

// --- zero pages ----------------------------------------------------------------------------

/// A `ZeroPages` body from raw fields.
fn zero_body(round: u32, count: u32, runs: &[(u64, u64)]) -> Vec<u8> {
    let mut b = round.to_le_bytes().to_vec();
    b.extend_from_slice(&count.to_le_bytes());
    for &(g, n) in runs {
        b.extend_from_slice(&g.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
    }
    b
}

#[test]
fn zero_runs_round_trip_and_count_as_sent_pages() {
    let mut w = Writer::start(Vec::new(), &desc()).unwrap();
    w.mem_batch(0, &[0, 1], &pages(&[0, 1], 0)).unwrap();
    w.zero_pages(0, &[(2, 14), (256, 3)]).unwrap();
    // Round 0 carried 2 pages of data and 17 zero pages.
    w.round_end(0, 19).unwrap();
    w.zero_pages(1, &[(0, 1)]).unwrap();
    w.round_end(1, 1).unwrap();
    w.state(b"s").unwrap();
    w.complete(20).unwrap();
    let (_, got) = read_all(&w.into_inner()).unwrap();
    assert_eq!(got[1], Owned::Zero(0, vec![(2, 14), (256, 3)]));
    assert_eq!(got[3], Owned::Zero(1, vec![(0, 1)]));
    assert_eq!(got.last(), Some(&Owned::Complete(20)));
    // The frame: tag 6, no flags, body = round, count, (gfn, pages) per run.
    let mut enc = Encoder::new();
    let mut out = Vec::new();
    enc.zero_pages(&mut out, 7, &[(2, 3)]).unwrap();
    assert_eq!(out, raw_frame(6, 0, 0, &zero_body(7, 1, &[(2, 3)])));
}

#[test]
fn the_encoder_refuses_bad_zero_runs_without_using_a_seq() {
    let mut enc = Encoder::new();
    let mut out = Vec::new();
    let too_many: Vec<(u64, u64)> = (0..MAX_ZERO_RUNS as u64 + 1).map(|i| (i * 2, 1)).collect();
    for runs in [&[][..], &[(5, 0)], &[(4, 2), (5, 1)], &[(4, 1), (3, 1)], &[(u64::MAX, 2)], &too_many] {
        assert!(matches!(enc.zero_pages(&mut out, 0, runs), Err(Error::BadRecord { seq: 0, .. })), "{runs:?}");
    }
    assert!(out.is_empty());
    assert_eq!(enc.seq(), 0);
    // Adjacent runs are allowed (a sender need not merge them).
    enc.zero_pages(&mut out, 0, &[(1, 1), (2, 1)]).unwrap();
}

#[test]
fn bad_zero_records_are_refused() {
    let zero = |round: u32, runs: &[(u64, u64)]| raw_frame(6, 0, 0, &zero_body(round, runs.len() as u32, runs));
    let reason = |frames: &[Vec<u8>]| match first_error(&with_header(frames)) {
        Error::BadRecord { seq: 0, reason } => reason,
        other => panic!("expected BadRecord, got {other:?}"),
    };
    assert!(reason(&[zero(1, &[(0, 1)])]).contains("round 1 during round 0"));
    assert!(reason(&[zero(0, &[])]).contains("0 runs"));
    assert!(reason(&[zero(0, &[(3, 0)])]).contains("empty zero run"));
    assert!(reason(&[zero(0, &[(4, 2), (5, 1)])]).contains("overlapping"));
    assert!(reason(&[zero(0, &[(4, 1), (2, 1)])]).contains("out of order"));
    assert!(reason(&[zero(0, &[(u64::MAX, 2)])]).contains("wraps"));
    // The count must match the body, and stay within its bound.
    assert!(reason(&[raw_frame(6, 0, 0, &zero_body(0, 2, &[(0, 1)]))]).contains("2 runs in a 24-byte body"));
    assert!(reason(&[raw_frame(6, 0, 0, &[0; 5])]).contains("shorter"));
    let big = zero_body(0, MAX_ZERO_RUNS as u32 + 1, &[]);
    assert!(reason(&[raw_frame(6, 0, 0, &big)]).contains("runs in a 8-byte body"));
    // Every page of a run lies in one described region (0..16 and 256..272).
    let out_of_range = |runs: &[(u64, u64)]| first_error(&with_header(&[zero(0, runs)]));
    assert!(matches!(out_of_range(&[(15, 2)]), Error::PageOutOfRange { gfn: 15, .. }));
    assert!(matches!(out_of_range(&[(16, 1)]), Error::PageOutOfRange { gfn: 16, .. }));
    assert!(matches!(out_of_range(&[(0, 300)]), Error::PageOutOfRange { gfn: 0, .. }));
    assert!(matches!(out_of_range(&[(270, 3)]), Error::PageOutOfRange { gfn: 270, .. }));
    // Zero pages count towards RoundEnd: a RoundEnd that leaves them out is refused.
    let end = raw_frame(2, 0, 1, &[0u32.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec()].concat());
    let e = first_error(&with_header(&[zero(0, &[(0, 2)]), end]));
    assert!(matches!(e, Error::BadRecord { seq: 1, .. }), "{e:?}");
    // Flags are not allowed on ZeroPages, and its body is bounded before it is read.
    let mut f = zero(0, &[(0, 1)]);
    f[1] = FLAG_ACK;
    assert!(matches!(first_error(&with_header(&[f])), Error::BadRecord { .. }));
    let mut hdr = zero(0, &[(0, 1)])[..16].to_vec();
    hdr[4..8].copy_from_slice(&(MAX_ZERO_BODY as u32 + 1).to_le_bytes());
    assert!(matches!(first_error(&with_header(&[hdr])), Error::Oversized { .. }));
}

#[test]
fn zero_pages_are_split_from_a_batch_in_order_with_their_data() {
    let mut zero_page = vec![0u8; PAGE];
    assert!(is_zero_page(&zero_page));
    // One byte anywhere makes a page non-zero, the last one included.
    for at in [0, 63, 64, 2048, PAGE - 1] {
        zero_page[at] = 1;
        assert!(!is_zero_page(&zero_page), "byte {at}");
        zero_page[at] = 0;
    }
    // gfns 10..16 and 20; pages 11, 12 and 20 hold zeros.
    let mut gfns = vec![10, 11, 12, 13, 14, 15, 20];
    let zero = [false, true, true, false, false, false, true];
    let mut data: Vec<u8> = gfns.iter().zip(zero).flat_map(|(&g, z)| vec![if z { 0 } else { g as u8 }; PAGE]).collect();
    let found: Vec<bool> = data.chunks(PAGE).map(is_zero_page).collect();
    assert_eq!(found, zero);
    let runs = split_zero_pages(&mut gfns, &mut data, |i| found[i]);
    assert_eq!(runs, [(11, 2), (20, 1)]);
    assert_eq!(gfns, [10, 13, 14, 15]);
    for (i, &g) in gfns.iter().enumerate() {
        assert!(data[i * PAGE..(i + 1) * PAGE].iter().all(|&b| b == g as u8), "page {g} moved with its data");
    }
    // Without data (zero-copy senders keep none), only the gfns change.
    let mut gfns = vec![1, 2, 3];
    assert_eq!(split_zero_pages(&mut gfns, &mut [], |i| i != 1), [(1, 1), (3, 1)]);
    assert_eq!(gfns, [2]);
}
