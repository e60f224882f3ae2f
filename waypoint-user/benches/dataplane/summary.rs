//! Summaries of repeated figures: percentages, median with min and max, and their
//! table cells and JSON.

use serde_json::{json, Value};

pub(crate) fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

/// Median with min and max; NaN-free inputs assumed.
pub(crate) fn spread(mut xs: Vec<f64>) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let median = if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    };
    (median, xs[0], xs[n - 1])
}

pub(crate) fn cell(xs: Vec<f64>, decimals: usize) -> String {
    let (m, lo, hi) = spread(xs);
    if lo == hi {
        format!("{m:.decimals$}")
    } else {
        format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})")
    }
}

pub(crate) fn summary_json(xs: Vec<f64>) -> Value {
    let (m, lo, hi) = spread(xs.clone());
    json!({ "median": m, "min": lo, "max": hi, "runs": xs })
}
