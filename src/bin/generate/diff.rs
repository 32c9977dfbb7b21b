//! `generate diff A B`: stage by stage, in forward order, how far trace A is from trace B.

use anyhow::Result;
use mla_engine::trace::{compare, first_divergence, Comparison, Trace};
use std::path::Path;

pub fn run(a: &Path, b: &Path, threshold: f64) -> Result<()> {
    let (ta, tb) = (Trace::load(a)?, Trace::load(b)?);
    let rows = compare(&ta, &tb);
    if rows.is_empty() {
        anyhow::bail!(
            "{} and {} have no stage in common",
            a.display(),
            b.display()
        );
    }
    println!("{:<20} {:>14}  relative error", "stage", "shape");
    for (name, cmp) in &rows {
        let shape = format!("{:?}", ta.get(name).unwrap().shape);
        let value = match cmp {
            Comparison::Relative(e) => format!("{e:.3e}"),
            Comparison::Ids { differ, total } => format!("{differ} of {total} ids differ"),
            Comparison::Mismatch(m) => m.clone(),
        };
        let mark = if cmp.diverges(threshold) { "  <--" } else { "" };
        println!("{name:<20} {shape:>14}  {value}{mark}");
    }
    match first_divergence(&rows, threshold) {
        Some(name) => println!("first divergence beyond {threshold:.0e}: {name}"),
        None => println!(
            "no stage beyond {threshold:.0e} ({} stages compared)",
            rows.len()
        ),
    }
    Ok(())
}
