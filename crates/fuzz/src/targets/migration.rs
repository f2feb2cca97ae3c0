//! The migration stream as a destination reads it (`kumo_migration::Reader`, the header, and
//! a source's `ReplyReader`): streams a `Writer` made from arbitrary records (valid CRCs over
//! whatever a peer may put in them), then changed byte-wise.

use kumo_migration::format::{Irqchip, PayloadDescription, PAGE_SIZE};
use kumo_migration::{Checksum, Reader, Record, ReplyReader, VmDescription, Writer};

use crate::{CaseResult, Input};

const PAGE: usize = PAGE_SIZE as usize;

fn description(u: &mut Input<'_>) -> arbitrary::Result<VmDescription> {
    let regions = if u.ratio(7, 8)? {
        vec![(0, 16 * PAGE as u64), (0x10_0000, 16 * PAGE as u64)]
    } else {
        (0..u.int_in_range(0..=3)?)
            .map(|_| Ok((u.arbitrary::<u64>()? & !0xfff, u.int_in_range(0..=64)? * PAGE as u64)))
            .collect::<arbitrary::Result<_>>()?
    };
    let cpus = if u.ratio(7, 8)? { 2 } else { u.arbitrary()? };
    Ok(VmDescription::new(cpus, Irqchip::Kernel, PayloadDescription::guest("memtouch"), regions))
}

/// A stream of arbitrary records; the writer frames them, the grammar is the peer's choice.
fn stream(u: &mut Input<'_>, desc: &VmDescription) -> arbitrary::Result<Vec<u8>> {
    let Ok(mut w) = Writer::start(Vec::new(), desc) else { return Ok(Vec::new()) };
    for _ in 0..u.int_in_range(0..=8)? {
        let _ = match u.int_in_range(0..=6)? {
            0 | 1 => {
                let gfns: Vec<u64> = (0..u.int_in_range(0..=4)?)
                    .map(|_| Ok(if u.ratio(7, 8)? { u.int_in_range(0..=0x110)? } else { u.arbitrary()? }))
                    .collect::<arbitrary::Result<_>>()?;
                let data = vec![u.arbitrary::<u8>()?; gfns.len() * PAGE];
                let slices: Vec<&[u8]> = data.chunks(PAGE).collect();
                let c = if u.arbitrary()? { Checksum::Full } else { Checksum::MetadataOnly };
                w.mem_batch_vectored(u.int_in_range(0..=2)?, &gfns, &slices, c)
            }
            2 => w.round_end(u.int_in_range(0..=2)?, u.int_in_range(0..=8)?),
            3 => w.state(&u.arbitrary::<Vec<u8>>()?),
            4 => w.complete(u.int_in_range(0..=8)?),
            5 => {
                let runs: Vec<(u64, u64)> = (0..u.int_in_range(0..=3)?)
                    .map(|_| {
                        let first = if u.ratio(7, 8)? { u.int_in_range(0..=0x110)? } else { u.arbitrary()? };
                        let pages = if u.ratio(7, 8)? { u.int_in_range(0..=20)? } else { u.arbitrary()? };
                        Ok((first, pages))
                    })
                    .collect::<arbitrary::Result<_>>()?;
                w.zero_pages(u.int_in_range(0..=2)?, &runs)
            }
            _ => w.abort(u.arbitrary()?),
        };
    }
    Ok(w.into_inner())
}

fn mutate(u: &mut Input<'_>, v: &mut Vec<u8>) -> arbitrary::Result<()> {
    for _ in 0..u.int_in_range(0..=3)? {
        let at = u.int_in_range(0..=v.len())?;
        match u.int_in_range(0..=3)? {
            0 if at < v.len() => v[at] ^= 1 << u.int_in_range(0..=7)?,
            1 => v.truncate(at),
            2 => v.insert(at, u.arbitrary()?),
            _ if at + 4 <= v.len() => v[at..at + 4].copy_from_slice(&u.arbitrary::<[u8; 4]>()?),
            _ => {}
        }
    }
    Ok(())
}

/// Reads a stream as a destination does; checks what the reader promises of what it returns.
fn read(bytes: &[u8]) {
    let Ok((mut r, desc)) = Reader::open(bytes) else { return };
    assert!(desc.validate().is_ok(), "the reader returned a description it should have refused: {desc:?}");
    let inside = |gfn: u64| {
        let a = gfn * PAGE as u64;
        desc.regions.iter().any(|&(start, len)| a >= start && a - start < len)
    };
    let mut states = 0;
    loop {
        match r.next_record() {
            Ok(Some(Record::MemBatch(b))) => {
                assert_eq!(b.data.len(), b.gfns.len() * PAGE, "a batch's data does not match its gfns");
                assert!(b.gfns.iter().all(|&g| inside(g)), "a gfn outside the described memory: {:?}", b.gfns);
            }
            Ok(Some(Record::ZeroPages { runs, .. })) => {
                assert!(!runs.is_empty(), "an empty ZeroPages record");
                assert!(runs.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "zero runs overlap: {runs:?}");
                assert!(runs.iter().all(|&(g, n)| n > 0 && inside(g) && inside(g + n - 1)), "{runs:?}");
            }
            Ok(Some(Record::State(_))) => states += 1,
            Ok(Some(Record::Complete { .. })) => {
                assert_eq!(states, 1, "Complete without exactly one State");
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let desc = description(u)?;
    let mut bytes = stream(u, &desc)?;
    if u.ratio(3, 4)? {
        mutate(u, &mut bytes)?;
    }
    read(&bytes);
    // What a destination answers, as the source reads it.
    let replies: Vec<u8> = u.arbitrary()?;
    let mut rr = ReplyReader::new(&replies[..]);
    for _ in 0..8 {
        if rr.next_reply().is_err() {
            break;
        }
    }
    Ok(())
}
