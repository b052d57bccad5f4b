//! The devices load's schedule, shared by its MQTT and DMI halves: what each device reports
//! and when the steady part of a run begins.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds of the run left out of the steady-state p99.
pub(crate) const WARM_UP: u64 = 5;

/// The temperature device `j` reports in second `k` of a run, for `n = j + k`.
pub(crate) fn report_value(n: usize) -> String {
    (15 + n % 20).to_string()
}

/// Wall-clock milliseconds, as mappers put in `timestamp`.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
