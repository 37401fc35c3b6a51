//! A plan as people read it: the table, the notes, layer lists.

use crate::cost::ratio;
use crate::spec::Plan;
use crate::spec::StageBytes;
use omni_engine::units::fmt_bytes;
use std::fmt;

/// Layers as people read them: "3-5,7"; "none" for none.
pub fn fmt_layers(layers: &[u32]) -> String {
    if layers.is_empty() {
        return "none".into();
    }
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        runs.push(if j == i {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    runs.join(",")
}

/// "layer 3", "layers 3-5,7".
pub(crate) fn layers_phrase(layers: &[u32]) -> String {
    match layers {
        [one] => format!("layer {one}"),
        _ => format!("layers {}", fmt_layers(layers)),
    }
}

/// "10" for 0.10, "12.5" for 0.125.
pub(crate) fn pct(x: f64) -> String {
    let p = x * 100.0;
    if (p - p.round()).abs() < 1e-9 {
        format!("{}", p.round())
    } else {
        format!("{p:.1}")
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "{} ({}, {} layers): context {} x {}, micro-batch {}, headroom {}%",
            self.model,
            self.arch,
            self.n_layer,
            c.n_ctx,
            omni_engine::count(c.n_seq as u64, "sequence"),
            c.n_ubatch,
            pct(c.headroom)
        )?;
        let offloading = self.stages.iter().any(|s| !s.offloaded.is_empty());
        let mut header = vec!["stage", "worker", "device", "layers"];
        if offloading {
            header.push("experts out");
        }
        header.extend(["weights", "KV", "compute", "total", "budget", "free", "use"]);
        let rows: Vec<Vec<String>> = self
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut r = vec![
                    i.to_string(),
                    s.worker.clone(),
                    s.device.clone(),
                    s.range.to_string(),
                ];
                if offloading {
                    r.push(if s.offloaded.is_empty() {
                        "-".into()
                    } else {
                        fmt_layers(&s.offloaded)
                    });
                }
                r.extend(byte_cells(&s.bytes, true));
                r
            })
            .collect();
        let text = if offloading { 1..=4 } else { 1..=3 };
        table(f, &header, &rows, text)?;
        if !self.experts.is_empty() {
            writeln!(f, "expert workers:")?;
            let header = [
                "worker", "device", "layers", "weights", "compute", "total", "budget", "free",
                "use",
            ];
            let rows: Vec<Vec<String>> = self
                .experts
                .iter()
                .map(|e| {
                    let mut r = vec![e.worker.clone(), e.device.clone(), fmt_layers(&e.layers)];
                    r.extend(byte_cells(&e.bytes, false));
                    r
                })
                .collect();
            table(f, &header, &rows, 0..=2)?;
        }
        if !self.notes.is_empty() {
            writeln!(f, "notes:")?;
            for n in &self.notes {
                writeln!(f, "  - {n}")?;
            }
        }
        Ok(())
    }
}

/// weights, [KV,] compute, total, budget, free, use.
pub(crate) fn byte_cells(b: &StageBytes, kv: bool) -> Vec<String> {
    let mut r = vec![fmt_bytes(b.weights)];
    if kv {
        r.push(fmt_bytes(b.kv));
    }
    r.extend([
        fmt_bytes(b.compute),
        fmt_bytes(b.total),
        fmt_bytes(b.budget),
        fmt_bytes(b.free),
        format!("{:.0}%", ratio(b.total, b.budget) * 100.0),
    ]);
    r
}

/// Columns in `text` left-aligned, the numbers right-aligned.
pub(crate) fn table(
    f: &mut fmt::Formatter<'_>,
    header: &[&str],
    rows: &[Vec<String>],
    text: std::ops::RangeInclusive<usize>,
) -> fmt::Result {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (k, (cell, &w)) in cells.zip(&width).enumerate() {
            if k > 0 {
                s.push_str("  ");
            }
            if text.contains(&k) {
                s.push_str(&format!("{cell:<w$}"));
            } else {
                s.push_str(&format!("{cell:>w$}"));
            }
        }
        writeln!(f, "{}", s.trim_end())
    };
    line(f, &mut header.iter().copied())?;
    for r in rows {
        line(f, &mut r.iter().map(String::as_str))?;
    }
    Ok(())
}
