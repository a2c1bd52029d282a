//! Results files: JSON with the provenance every figure needs (commit, date, device), written
//! atomically.
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::Path;

/// What produced a results file.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Provenance {
    pub commit: String,
    pub command: String,
    pub date_utc: String,
    pub device: String,
    /// The `WIDE_*` environment knobs set for the run (kernel paths and sweep settings change
    /// what a figure measures); the locations of the machine's files are left out.
    pub knobs: std::collections::BTreeMap<String, String>,
}

impl Provenance {
    pub fn new(commit: &str, device: &str) -> Self {
        Self {
            commit: commit.to_string(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            date_utc: utc_now(),
            device: device.to_string(),
            knobs: knobs(std::env::vars()),
        }
    }
}

/// The `WIDE_*` variables among `vars`, without those that name paths of the machine.
fn knobs(vars: impl Iterator<Item = (String, String)>) -> std::collections::BTreeMap<String, String> {
    const PATHS: [&str; 10] = [
        "WIDE_KERNEL_CACHE",
        "WIDE_CUDA_INCLUDE",
        "WIDE_FONT",
        "WIDE_VENV",
        "WIDE_PYTHON",
        "WIDE_BIN",
        "WIDE_TEST_DATA",
        "WIDE_TEST_OUT",
        "WIDE_STAGE_DIR",
        "WIDE_WGMMA_SK_TRACE",
    ];
    vars.filter(|(k, _)| k.starts_with("WIDE_") && !PATHS.contains(&k.as_str())).collect()
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (no time-zone database needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil-from-days (proleptic Gregorian).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Writes pretty JSON to `path` through a temporary file.
pub fn write_json(path: &Path, value: &Value) -> Result<()> {
    write_text(path, &(serde_json::to_string_pretty(value)? + "\n"))
}

/// Writes `text` to `path` through a temporary file in the same folder (created if missing),
/// then renames it: an interrupted write never leaves a half file in place of the old one.
pub fn write_text(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    wide_train::recipe::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_now_is_well_formed() {
        let s = super::utc_now();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.starts_with("20") && s.ends_with('Z'));
    }

    #[test]
    fn knobs_keep_wide_settings_and_drop_paths() {
        let vars = [("WIDE_GEMV_SPLIT", "0"), ("WIDE_KERNEL_CACHE", "/x/kernels"), ("PATH", "/bin"), ("WIDE_WGMMA", "mi=1"), ("WIDE_WGMMA_SK_TRACE", "/x/t")];
        let k = super::knobs(vars.iter().map(|(a, b)| (a.to_string(), b.to_string())));
        assert_eq!(k.into_iter().collect::<Vec<_>>(), vec![("WIDE_GEMV_SPLIT".to_string(), "0".to_string()), ("WIDE_WGMMA".to_string(), "mi=1".to_string())]);
    }
}
