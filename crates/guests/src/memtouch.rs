//! A reference model of the `memtouch` guest: the checksum its working set must have after a
//! given number of writes. Lets tests check guest memory against an independent computation
//! (pause/restore now, migration later), not just against another run of the same guest.

const PAGE_WORDS: usize = 512;

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Checksum `memtouch pages=P mode=(random|seq) writes=W seed=S` reports.
pub fn expected_checksum(pages: u64, writes: u64, seed: u64, random: bool) -> u64 {
    let mut mem = vec![0u64; pages as usize * PAGE_WORDS];
    let mut rng = mix64(seed) | 1;
    for n in 0..writes {
        let page = if random {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % pages
        } else {
            n % pages
        };
        mem[page as usize * PAGE_WORDS + (n & 511) as usize] = mix64(n ^ (seed << 40));
    }
    mem.iter().fold(0xcbf2_9ce4_8422_2325u64, |s, w| (s ^ w).wrapping_mul(0x100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_on_every_parameter() {
        let base = expected_checksum(16, 100, 1, true);
        assert_eq!(base, expected_checksum(16, 100, 1, true));
        for other in [
            expected_checksum(17, 100, 1, true),
            expected_checksum(16, 101, 1, true),
            expected_checksum(16, 100, 2, true),
            expected_checksum(16, 100, 1, false),
        ] {
            assert_ne!(base, other);
        }
    }
}
