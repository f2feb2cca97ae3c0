//! [`PageBitmap`]: a set of guest pages, the unit pre-copy works in. The source's dirty log
//! fills one per round (`kumo_vm::dirty` reads KVM's log into it) and the rounds send its pages.

const PAGE_SIZE: u64 = crate::format::PAGE_SIZE as u64;

/// A set of guest pages, one bit per page, per RAM region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageBitmap {
    /// (first gfn of the region, pages in the region, bits)
    pub regions: Vec<(u64, u64, Vec<u64>)>,
}

impl PageBitmap {
    /// An empty bitmap shaped like the RAM regions `(gpa, len)` (page-aligned).
    pub fn for_regions(regions: &[(u64, u64)]) -> Self {
        PageBitmap {
            regions: regions
                .iter()
                .map(|&(gpa, len)| {
                    (gpa / PAGE_SIZE, len / PAGE_SIZE, vec![0u64; (len / PAGE_SIZE).div_ceil(64) as usize])
                })
                .collect(),
        }
    }

    /// Number of pages in the set.
    pub fn count(&self) -> u64 {
        self.regions.iter().map(|(_, _, b)| b.iter().map(|w| w.count_ones() as u64).sum::<u64>()).sum()
    }

    /// Empties the set.
    pub fn clear(&mut self) {
        for (_, _, b) in &mut self.regions {
            b.fill(0);
        }
    }

    /// Where page `gfn`'s bit lives: (region, word, mask); None if no region holds it.
    fn locate(&self, gfn: u64) -> Option<(usize, usize, u64)> {
        let r = self.regions.iter().position(|&(first, n, _)| gfn >= first && gfn < first + n)?;
        let i = gfn - self.regions[r].0;
        Some((r, (i / 64) as usize, 1 << (i % 64)))
    }

    /// Adds page `gfn`; false if no region holds it.
    pub fn set(&mut self, gfn: u64) -> bool {
        self.locate(gfn).map(|(r, w, m)| self.regions[r].2[w] |= m).is_some()
    }

    /// Whether page `gfn` is in the set.
    pub fn contains(&self, gfn: u64) -> bool {
        self.locate(gfn).is_some_and(|(r, w, m)| self.regions[r].2[w] & m != 0)
    }

    /// Adds page `gfn`; true if it was not in the set before (and a region holds it).
    pub fn set_new(&mut self, gfn: u64) -> bool {
        let Some((r, w, m)) = self.locate(gfn) else { return false };
        let word = &mut self.regions[r].2[w];
        let new = *word & m == 0;
        *word |= m;
        new
    }

    /// Adds every page of `other` (same shape) to this set.
    pub fn union(&mut self, other: &PageBitmap) {
        for ((_, _, a), (_, _, b)) in self.regions.iter_mut().zip(&other.regions) {
            for (x, y) in a.iter_mut().zip(b) {
                *x |= *y;
            }
        }
    }

    /// The set pages' frame numbers, ascending.
    pub fn gfns(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions.iter().flat_map(|(first, n, bits)| {
            bits.iter().enumerate().flat_map(move |(w, &word)| {
                let mut word = word;
                std::iter::from_fn(move || {
                    if word == 0 {
                        return None;
                    }
                    let b = word.trailing_zeros() as u64;
                    word &= word - 1;
                    Some(w as u64 * 64 + b)
                })
                .filter(move |i| i < n)
                .map(move |i| first + i)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_sets_and_lists_pages_across_regions() {
        let mut b = PageBitmap::for_regions(&[(0, 130 * PAGE_SIZE), (1 << 32, 64 * PAGE_SIZE)]);
        for g in [0, 63, 64, 129, (1 << 20) + 5] {
            assert!(b.set(g));
        }
        assert!(!b.set(130), "outside every region");
        assert_eq!(b.gfns().collect::<Vec<_>>(), vec![0, 63, 64, 129, (1 << 20) + 5]);
        assert_eq!(b.count(), 5);
        let mut c = PageBitmap::for_regions(&[(0, 130 * PAGE_SIZE), (1 << 32, 64 * PAGE_SIZE)]);
        c.set(7);
        c.union(&b);
        assert_eq!(c.count(), 6);
        c.clear();
        assert_eq!(c.count(), 0);
    }

    #[test]
    fn pages_are_found_in_their_region_and_nowhere_else() {
        // Pages 0..70 and 256..260 (a hole between).
        let mut b = PageBitmap::for_regions(&[(0, 70 * PAGE_SIZE), (256 * PAGE_SIZE, 4 * PAGE_SIZE)]);
        for g in [0, 63, 64, 69, 256, 259] {
            assert!(!b.contains(g));
            assert!(b.set_new(g), "{g} is new");
            assert!(!b.set_new(g), "{g} was set");
            assert!(b.contains(g) && b.set(g));
        }
        for g in [1, 62, 65, 258] {
            assert!(!b.contains(g), "{g}");
        }
        // Outside every region: never set, never in the set.
        for g in [70, 100, 255, 260, u64::MAX] {
            assert!(!b.set(g) && !b.set_new(g) && !b.contains(g), "{g}");
        }
        assert_eq!(b.count(), 6);
    }
}
