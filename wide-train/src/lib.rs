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
