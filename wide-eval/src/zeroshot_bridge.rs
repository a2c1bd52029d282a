//! Multiple-choice accuracy of a routed model, through the task harness.
use anyhow::{bail, Result};
use std::path::Path;
use wide_train::calibrate::RoutedModel;

/// (acc, acc_norm) of `m` on the JSONL task file `tasks`.
pub fn accuracy(_m: &RoutedModel, tasks: &Path) -> Result<(f64, f64)> {
    bail!("multiple-choice evaluation of {} is not wired into compare yet", tasks.display())
}
