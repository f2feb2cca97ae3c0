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

/// Checks a finished memtouch's console output against the model: its `done writes=W` line and
/// its `checksum=` line must agree with [`expected_checksum`]. Returns the writes; the error
/// quotes the output, so a test can show what the guest said.
pub fn check_output(out: &str, pages: u64, seed: u64, random: bool) -> Result<u64, String> {
    let value = |prefix: &str, key: &str| {
        out.lines()
            .filter(|l| l.starts_with(prefix))
            .flat_map(|l| l.split_whitespace())
            .find_map(|w| w.strip_prefix(key).map(str::to_string))
    };
    let writes: u64 = value("memtouch: done", "writes=")
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| format!("memtouch printed no `done writes=` line:\n{out}"))?;
    let sum = value("memtouch: checksum", "checksum=")
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .ok_or_else(|| format!("memtouch printed no `checksum=` line:\n{out}"))?;
    let want = expected_checksum(pages, writes, seed, random);
    if sum != want {
        return Err(format!("memtouch's checksum {sum:x} after {writes} writes is not the model's {want:x}:\n{out}"));
    }
    Ok(writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_checked_against_the_model() {
        let sum = expected_checksum(4, 10, 3, true);
        let good = format!("memtouch: done writes=10 elapsed_us=5\nmemtouch: checksum={sum:x}\n");
        assert_eq!(check_output(&good, 4, 3, true), Ok(10));
        assert!(check_output(&good, 4, 4, true).unwrap_err().contains("not the model's"));
        assert!(check_output("memtouch: checksum=1\n", 4, 3, true).unwrap_err().contains("no `done"));
        assert!(check_output("memtouch: done writes=10\n", 4, 3, true).unwrap_err().contains("no `checksum"));
    }

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
