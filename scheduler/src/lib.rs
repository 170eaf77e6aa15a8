//! strata-scheduler plans and simulates: from a training step's access trace,
//! tier capacities and link bandwidths it computes when to prefetch and what
//! to evict, and a discrete-event simulator predicts step time and memory per
//! tier. It is pure and deterministic: no I/O, no clock, no threads.
//!
//! Its types arrive with the scheduler issue.
