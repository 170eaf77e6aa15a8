//! Property tests for the extent allocator.

use proptest::prelude::*;
use strata_storage::ExtentAllocator;

#[derive(Debug, Clone)]
enum Action {
    Allocate(u64),
    AllocateFromTop(u64),
    Free(usize),
}

fn actions() -> impl Strategy<Value = Vec<Action>> {
    prop::collection::vec(
        prop_oneof![
            (1u64..200_000).prop_map(Action::Allocate),
            (1u64..200_000).prop_map(Action::AllocateFromTop),
            any::<usize>().prop_map(Action::Free),
        ],
        1..200,
    )
}

proptest! {
    #[test]
    fn never_overlaps_leaks_or_loses_space(actions in actions(), capacity_blocks in 1u64..512) {
        let align = 4096;
        let capacity = capacity_blocks * align;
        let mut alloc = ExtentAllocator::new(capacity, align);
        let mut live: Vec<(u64, u64)> = Vec::new();
        for action in actions {
            match action {
                Action::Allocate(len) | Action::AllocateFromTop(len) => {
                    let largest = alloc.largest_free_bytes();
                    let from_top = matches!(action, Action::AllocateFromTop(_));
                    let highest_fit = alloc
                        .free_list()
                        .filter(|&(_, l)| l >= len.div_ceil(align) * align)
                        .map(|(o, l)| o + l)
                        .last();
                    let placed = if from_top { alloc.allocate_from_top(len) } else { alloc.allocate(len) };
                    if let (true, Ok((offset, got))) = (from_top, &placed) {
                        // From the top: the end of the highest hole that fits.
                        prop_assert_eq!(Some(offset + got), highest_fit);
                    }
                    match placed {
                        Ok((offset, got)) => {
                            prop_assert!(got >= len && got % align == 0 && offset % align == 0);
                            prop_assert!(offset + got <= capacity);
                            for &(o, l) in &live {
                                prop_assert!(offset + got <= o || o + l <= offset, "overlap");
                            }
                            live.push((offset, got));
                        }
                        // Either end must succeed whenever a large enough hole exists.
                        Err(_) => prop_assert!(len.div_ceil(align) * align > largest),
                    }
                }
                Action::Free(pick) if !live.is_empty() => {
                    let (offset, len) = live.swap_remove(pick % live.len());
                    alloc.free(offset, len);
                }
                Action::Free(_) => {}
            }
            let allocated: u64 = live.iter().map(|&(_, l)| l).sum();
            prop_assert_eq!(alloc.allocated_bytes(), allocated);
            prop_assert_eq!(alloc.free_bytes() + allocated, capacity);
            // Free extents are sorted, disjoint, never adjacent (coalesced).
            let free: Vec<_> = alloc.free_list().collect();
            for pair in free.windows(2) {
                prop_assert!(pair[0].0 + pair[0].1 < pair[1].0);
            }
        }
        for (offset, len) in live.drain(..) {
            alloc.free(offset, len);
        }
        prop_assert_eq!(alloc.free_extents(), usize::from(capacity > 0));
        prop_assert_eq!(alloc.free_bytes(), capacity);
    }
}
