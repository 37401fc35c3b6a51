//! `omnictl top`: a live view of a running cluster in the terminal
//! (ratatui): every worker with its layers as a bar over the model's
//! layers, tokens per second, step time, busy fraction (the share of the
//! interval its stage computed), planned memory against the
//! device's, KV cells in use and health, refreshed every `--interval`
//! seconds from the admin API. `q` or Esc quits. `--once` prints one frame
//! as text and exits (for scripts and logs).

use crate::admin::{admin_client, AdminArgs};
use clap::Args;
use omni_proto::admin::v1::{ListWorkersReply, ListWorkersRequest, WorkerInfo};
use ratatui::crossterm::event::{self, Event, KeyCode};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print one frame as text and exit (the rates over one interval).
    #[arg(long)]
    pub once: bool,
}

/// Two snapshots make rates.
struct Sample {
    at: Instant,
    reply: ListWorkersReply,
}

/// One frame's numbers, from the newest snapshot and the one before.
struct Frame {
    title: String,
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
    healthy: Vec<bool>,
}

const BAR: usize = 32;

/// `████····` over the model's layers: which of them the worker holds.
fn layer_bar(n_layer: u32, held: impl Fn(u32) -> bool) -> String {
    let n = n_layer.max(1) as usize;
    let width = n.min(BAR);
    (0..width)
        .map(|i| {
            // Each character covers layers [i*n/width, (i+1)*n/width).
            let (a, b) = (
                (i * n / width) as u32,
                (((i + 1) * n).div_ceil(width)) as u32,
            );
            if (a..b.max(a + 1)).any(&held) {
                '█'
            } else {
                '·'
            }
        })
        .collect()
}

fn frame(now: &Sample, before: Option<&Sample>) -> Frame {
    use omni_engine::fmt_bytes;
    let r = &now.reply;
    let secs = before.map(|b| (now.at - b.at).as_secs_f64().max(1e-3));
    let tok_s = match (before, secs) {
        (Some(b), Some(s)) => format!(
            "{:.1}",
            r.tokens_out.saturating_sub(b.reply.tokens_out) as f64 / s
        ),
        _ => "-".into(),
    };
    let earlier: HashMap<&str, &WorkerInfo> = before
        .map(|b| b.reply.workers.iter().map(|w| (w.id.as_str(), w)).collect())
        .unwrap_or_default();
    // Speculative decoding's acceptance over the interval, or since the
    // coordinator started when nothing was drafted in it.
    let interval = before.map_or((0, 0), |b| {
        (
            r.draft_tokens.saturating_sub(b.reply.draft_tokens),
            r.draft_accepted.saturating_sub(b.reply.draft_accepted),
        )
    });
    let ((drafted, accepted), when) = if interval.0 > 0 {
        (interval, "")
    } else {
        ((r.draft_tokens, r.draft_accepted), " since start")
    };
    let drafts = if drafted > 0 {
        format!(
            " | drafts {:.0}% accepted ({accepted} of {drafted}{when})",
            100.0 * accepted as f64 / drafted as f64
        )
    } else {
        String::new()
    };
    let title = format!(
        "omni: {} | {} layers | {} running | {tok_s} tokens/s out{drafts}",
        r.model,
        r.n_layer,
        omni_engine::count(r.active_sequences.max(0) as u64, "sequence")
    );
    let header = vec![
        "worker", "kind", "device", "layers", "range", "tok/s in", "step ms", "busy", "memory",
        "KV cells", "health",
    ];
    let mut rows = Vec::new();
    let mut healthy = Vec::new();
    for w in &r.workers {
        let stage = w.kind == "stage";
        let bar = if stage {
            layer_bar(r.n_layer, |l| (w.layer_start..w.layer_end).contains(&l))
        } else {
            layer_bar(r.n_layer, |l| w.expert_layers.contains(&l))
        };
        let before = earlier.get(w.id.as_str()).filter(|_| stage);
        let rate = match (before, secs) {
            (Some(b), Some(s)) => format!("{:.1}", w.tokens.saturating_sub(b.tokens) as f64 / s),
            _ => "-".into(),
        };
        // The stage thread's share of the interval spent computing (the
        // rest: sending on, waiting for input); the slowest stage of a
        // pipeline is the busiest.
        let busy = match before {
            Some(b) if w.uptime_seconds > b.uptime_seconds => format!(
                "{:.0}%",
                100.0 * (w.compute_seconds - b.compute_seconds)
                    / (w.uptime_seconds - b.uptime_seconds)
            ),
            _ => "-".into(),
        };
        rows.push(vec![
            w.id.clone(),
            if w.drained {
                "drained".into()
            } else if stage {
                format!("stage {}", w.stage)
            } else {
                "experts".into()
            },
            w.device.clone(),
            bar,
            if stage {
                w.layers.clone()
            } else {
                format!("experts of {}", w.layers)
            },
            rate,
            if stage && !w.drained {
                format!("{:.2}", w.last_step_ms)
            } else {
                "-".into()
            },
            busy,
            format!(
                "{} of {}",
                fmt_bytes(w.memory_planned),
                fmt_bytes(w.memory_total)
            ),
            if stage {
                format!("{}/{}", w.kv_cells_used, w.kv_cells_total)
            } else {
                "-".into()
            },
            w.health.clone(),
        ]);
        healthy.push(w.health == "serving");
    }
    Frame {
        title,
        header,
        rows,
        healthy,
    }
}

/// Spaces between columns.
const SPACING: usize = 2;

/// Each column's width: its widest cell or header.
fn column_widths(f: &Frame) -> Vec<usize> {
    let mut widths: Vec<usize> = f.header.iter().map(|h| h.chars().count()).collect();
    for r in &f.rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    widths
}

/// Which columns to show in `width` characters, in their order: as many
/// as fit, the most telling first (worker, range, health, rates, ...; the
/// layer bar and the device go first when space is short).
fn fit(widths: &[usize], width: usize) -> Vec<usize> {
    // Indices into the header: worker, range, health, tok/s, step ms,
    // busy, kind, memory, KV cells, device, layers (the bar).
    const PRIORITY: [usize; 11] = [0, 4, 10, 5, 6, 7, 1, 8, 9, 2, 3];
    let mut keep = Vec::new();
    let mut used = 0;
    for i in PRIORITY.into_iter().filter(|&i| i < widths.len()) {
        let need = widths[i] + if keep.is_empty() { 0 } else { SPACING };
        if used + need <= width {
            used += need;
            keep.push(i);
        }
    }
    keep.sort_unstable();
    keep
}

/// The frame as plain text columns (`--once`).
fn text(f: &Frame) -> String {
    let widths = column_widths(f);
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (c, w) in cells.iter().zip(&widths) {
            s.push_str(c);
            s.push_str(&" ".repeat(w - c.chars().count() + SPACING));
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = f.title.clone() + "\n";
    out += &line(f.header.clone());
    for r in &f.rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

pub fn run(a: &TopArgs) -> anyhow::Result<()> {
    run_view(a).map_err(|e| a.admin.explain(e))
}

fn run_view(a: &TopArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // One model's cluster, or every model of a launch of several (each
    // its own section, under its name).
    let models = crate::admin::each_model(&a.admin);
    let mut clients = Vec::new();
    for (name, admin) in &models {
        let c = rt.block_on(admin_client(admin)).map_err(|e| match name {
            Some(n) => admin.explain(e).context(format!("model '{n}'")),
            None => e,
        })?;
        clients.push((name.clone(), c));
    }
    let interval = Duration::from_secs_f64(a.interval.max(0.1));
    let mut snap = || -> anyhow::Result<Vec<Sample>> {
        let mut out = Vec::new();
        for (name, client) in &mut clients {
            let mut reply = rt
                .block_on(client.list_workers(ListWorkersRequest {}))
                .map_err(crate::admin::refused)?
                .into_inner();
            if let Some(n) = name {
                reply.model = format!("'{n}' {}", reply.model);
            }
            out.push(Sample {
                at: Instant::now(),
                reply,
            });
        }
        Ok(out)
    };
    let frames = |now: &[Sample], before: Option<&Vec<Sample>>| -> Vec<Frame> {
        now.iter()
            .enumerate()
            .map(|(i, s)| frame(s, before.and_then(|b| b.get(i))))
            .collect()
    };
    use std::io::IsTerminal;
    let terminal = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
    if !a.once && !terminal {
        eprintln!("omnictl top: not a terminal, so one frame as text (as with --once)");
    }
    if a.once || !terminal {
        let first = snap()?;
        std::thread::sleep(interval);
        let second = snap()?;
        let texts: Vec<String> = frames(&second, Some(&first)).iter().map(text).collect();
        print!("{}", texts.join("\n"));
        return Ok(());
    }
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        let mut before: Option<Vec<Sample>> = None;
        let mut now = snap()?;
        loop {
            let fs = frames(&now, before.as_ref());
            terminal.draw(|t| {
                // Each model: its title, then its table (a border line, the
                // header, a row per worker); the last one takes what is left.
                let mut constraints: Vec<Constraint> = Vec::new();
                for (i, f) in fs.iter().enumerate() {
                    constraints.push(Constraint::Length(1));
                    constraints.push(if i + 1 == fs.len() {
                        Constraint::Min(3)
                    } else {
                        Constraint::Length(f.rows.len() as u16 + 2)
                    });
                }
                constraints.push(Constraint::Length(1));
                let areas = Layout::vertical(constraints).split(t.area());
                for (i, f) in fs.iter().enumerate() {
                    let (top, body) = (areas[2 * i], areas[2 * i + 1]);
                    t.render_widget(
                        Paragraph::new(f.title.clone())
                            .style(Style::default().add_modifier(Modifier::BOLD)),
                        top,
                    );
                    let rows = f.rows.iter().zip(&f.healthy).map(|(r, ok)| {
                        let style = if *ok {
                            Style::default()
                        } else {
                            Style::default().fg(Color::Red)
                        };
                        (r, style)
                    });
                    // The columns that fit the terminal, each as wide as its
                    // widest cell, so that none runs into the next.
                    let keep = fit(&column_widths(f), usize::from(body.width));
                    let widths = keep
                        .iter()
                        .map(|&i| Constraint::Length(column_widths(f)[i] as u16));
                    let rows = rows.map(|(r, style)| {
                        Row::new(keep.iter().map(|&i| Cell::from(r[i].clone()))).style(style)
                    });
                    t.render_widget(
                        Table::new(rows, widths)
                            .column_spacing(SPACING as u16)
                            .header(
                                Row::new(keep.iter().map(|&i| f.header[i]))
                                    .style(Style::default().add_modifier(Modifier::BOLD)),
                            )
                            .block(Block::default().borders(Borders::TOP)),
                        body,
                    );
                }
                t.render_widget(
                    Paragraph::new(format!(
                        "refresh every {:.1}s from the admin API at {} | q quits",
                        interval.as_secs_f64(),
                        a.admin.admin
                    )),
                    areas[areas.len() - 1],
                );
            })?;
            let deadline = Instant::now() + interval;
            while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                if event::poll(left)? {
                    if let Event::Key(k) = event::read()? {
                        if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) {
                            return Ok(());
                        }
                    }
                }
            }
            before = Some(now);
            now = snap()?;
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_bars_cover_the_held_layers() {
        assert_eq!(layer_bar(4, |l| (0..2).contains(&l)), "██··");
        assert_eq!(layer_bar(4, |l| [1, 3].contains(&l)), "·█·█");
        // 64 layers on 32 characters: two layers a character.
        let b = layer_bar(64, |l| (10..20).contains(&l));
        assert_eq!(b.chars().count(), 32);
        assert_eq!(b.chars().filter(|&c| c == '█').count(), 5);
        // 61 layers (DeepSeek-R1): the last layer still shows.
        assert!(layer_bar(61, |l| l == 60).ends_with('█'));
    }

    /// A two-stage Gemma cluster's frame.
    fn gemma_frame() -> Frame {
        let w = |id: &str, stage: u32, start: u32, end: u32| WorkerInfo {
            id: id.into(),
            kind: "stage".into(),
            device: "cpu".into(),
            stage,
            layer_start: start,
            layer_end: end,
            layers: format!("embed + layers {start}-{}", end - 1),
            memory_total: 23 << 30,
            memory_planned: 300 << 20,
            kv_cells_total: 8192,
            health: "serving".into(),
            ..Default::default()
        };
        let reply = ListWorkersReply {
            model: "gemma3-270m".into(),
            n_layer: 18,
            workers: vec![w("w0", 0, 0, 9), w("w1", 1, 9, 18)],
            ..Default::default()
        };
        frame(
            &Sample {
                at: Instant::now(),
                reply,
            },
            None,
        )
    }

    #[test]
    fn the_columns_fit_80_characters_and_all_show_at_160() {
        let f = gemma_frame();
        let widths = column_widths(&f);
        let used = |keep: &[usize]| -> usize {
            keep.iter().map(|&i| widths[i]).sum::<usize>() + SPACING * (keep.len() - 1)
        };
        let narrow = fit(&widths, 80);
        assert!(used(&narrow) <= 80, "{narrow:?} {widths:?}");
        for must in ["worker", "range", "health", "tok/s in"] {
            let i = f.header.iter().position(|h| *h == must).unwrap();
            assert!(narrow.contains(&i), "{must} shows at 80 columns");
        }
        let wide = fit(&widths, 160);
        assert_eq!(wide.len(), f.header.len(), "every column at 160");
        // Each column is as wide as its widest cell: none runs into the next.
        for r in &f.rows {
            for (c, w) in r.iter().zip(&widths) {
                assert!(c.chars().count() <= *w);
            }
        }
    }
}
