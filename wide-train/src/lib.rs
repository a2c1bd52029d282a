//! Training: the data pipeline (corpora, BPE tokenizers, packed token datasets), the trainer
//! core (AdamW in tch ops, schedules, accumulation, clipping, atomic checkpoints and resume,
//! TensorBoard scalars, progress bars) and the stages built on it: stage 0 pretraining of the
//! testbed models, router calibration and LoRA recovery, and the export of trained models for
//! other runtimes.
pub mod corpus;
pub mod bpe;
pub mod dataset;
pub mod progress;
pub mod optim;
pub mod trainer;
pub mod baselines;
pub mod pretrain;
pub mod recipe;
pub mod calibrate;
pub mod dist;
pub mod export;

/// Tests that draw from libtorch's global random generator (or reseed it, as the trainer does
/// per sample) take this lock: the test threads of one binary share that generator, so a draw
/// of one test between another's seed and its draws changes the other's numbers.
#[cfg(test)]
pub(crate) fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}
