//! Evaluation and measurement: perplexity, the multiple-choice harness, variant comparisons
//! and sweeps build here; so do the benchmark programs (`wide bench ...`), which print tables
//! and write JSON results that record the git commit, device and date.
pub mod bench;
pub mod report;
pub mod plots;
pub mod perplexity;
pub mod zeroshot;
pub mod cli;
pub mod compare;
pub mod reuse;
pub mod sweep;
