//! The one progress facility: indicatif bars on a terminal, periodic plain lines otherwise
//! (cluster logs), both on stderr.
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template("{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} {msg} (ETA {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_prefix(what.to_string());
    pb
}
