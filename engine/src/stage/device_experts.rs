//! Routed experts a stage keeps on its device beside the expert worker
//! that holds them all, and how a step's selections split between the two.

use crate::error::EngineError;
use crate::ffi::ggml;
use crate::ffi::ggml::Buffer;
use crate::ffi::ggml::BufferType;
use crate::ffi::ggml::Tensor;
use crate::ffi::ggml::TensorStore;
use crate::model::ModelFile;

/// The routed experts of one offloaded layer that a stage keeps after
/// all (`Stage::set_device_experts`): `ffn_{up,gate,down}_exps`, in that
/// order, cut down to those experts (`[.., .., K]`), each in its own
/// buffer: repacked where llama.cpp's loader would repack the whole tensor
/// (so the stage runs the executor's kernels), else plain.
pub(super) struct DeviceExperts {
    /// The experts held, ascending: local expert `i` is `ids[i]`.
    pub(super) ids: Vec<u32>,
    pub(super) tensors: Vec<(TensorStore, Buffer)>,
    pub(super) bytes: u64,
}

impl DeviceExperts {
    /// Copies the slices of experts `ids` of layer `il` out of the file.
    pub(super) fn load(
        model: &ModelFile,
        il: u32,
        ids: Vec<u32>,
        buft: BufferType,
        repack: bool,
    ) -> Result<DeviceExperts, EngineError> {
        let g = &model.gguf;
        let n_used = model
            .hparams
            .moe
            .as_ref()
            .map_or(1, |m| m.n_expert_used as i64);
        let repack_buft = if repack {
            ggml::cpu_extra_buffer_types()
                .map_err(EngineError::CpuBackend)?
                .first()
                .copied()
        } else {
            None
        };
        let mut tensors = Vec::with_capacity(3);
        let mut bytes = 0;
        for name in ["ffn_up_exps", "ffn_gate_exps", "ffn_down_exps"] {
            let name = format!("blk.{il}.{name}.weight");
            let info = g.tensor(&name).ok_or_else(|| EngineError::MissingTensor {
                name: name.clone(),
                arch: model.hparams.arch.name(),
            })?;
            // Experts are the outermost dimension: each one's bytes are
            // one contiguous slice (whole quantization blocks).
            let n_expert = info.dims[2] as usize;
            let per = info.size as usize / n_expert;
            let src = g.tensor_data(info)?;
            let mut data = Vec::with_capacity(per * ids.len());
            for &id in &ids {
                data.extend_from_slice(&src[id as usize * per..(id as usize + 1) * per]);
            }
            let mut store = TensorStore::new(1);
            let ne = [info.dims[0] as i64, info.dims[1] as i64, ids.len() as i64];
            store.add(info.ggml_type.id(), &ne, &name);
            // Asked of the whole tensor, as the executor's loader asks, and
            // of the subset, which is what the kernel gets.
            let mut whole = TensorStore::new(1);
            let dims: Vec<i64> = info.dims.iter().map(|&d| d as i64).collect();
            whole.add(info.ggml_type.id(), &dims, &name);
            let target = repack_buft
                .filter(|&b| {
                    let read = ggml::WeightRead::MulMatId(n_used);
                    ggml::buft_supports(b, whole.get(0), read)
                        && ggml::buft_supports(b, store.get(0), read)
                })
                .unwrap_or(buft);
            let buffer =
                Buffer::alloc_ctx(store.ctx(), target).ok_or(EngineError::OutOfMemory {
                    what: format!("layer {il}'s {} device experts", ids.len()),
                    bytes: data.len() as u64,
                })?;
            store.get(0).write_bytes(&data);
            bytes += data.len() as u64;
            tensors.push((store, buffer));
        }
        Ok(DeviceExperts {
            ids,
            tensors,
            bytes,
        })
    }

    /// `ffn_up_exps`, `ffn_gate_exps`, `ffn_down_exps` of the experts held.
    pub(super) fn weights(&self) -> [Tensor<'_>; 3] {
        [0, 1, 2].map(|i| self.tensors[i].0.get(0))
    }
}

/// One offloaded block's selections split between the experts kept on the
/// stage and the executor. Each side gets, per token, its own selections
/// in selection order, padded to the side's width (the most any token has
/// there) with weight-0 stand-ins, which add exactly 0. `mul_mat_id` needs
/// the same count for every token, and ggml's repacked CPU kernel needs
/// distinct ids within a token (it keeps at most one row per expert and
/// token), so the stand-ins are experts that side computes for another
/// token of the batch anyway: no expert's weights are read for nothing.
#[derive(Debug, PartialEq)]
pub(super) struct SplitWork {
    /// The stage's part, for every token: local ids into the device subset
    /// and weights, `[n_tokens][dev_width]`; width 0 when no token selected
    /// an expert kept here.
    pub(super) dev_width: usize,
    pub(super) dev_ids: Vec<i32>,
    pub(super) dev_weights: Vec<f32>,
    /// The executor's part: the tokens with an expert elsewhere, ascending,
    /// and their ids and weights, `[rows.len()][width]`.
    pub(super) rows: Vec<usize>,
    pub(super) width: usize,
    pub(super) ids: Vec<i32>,
    pub(super) weights: Vec<f32>,
}

/// Splits `ids` and `weights` (`[n_tokens][n_used]`) between the experts
/// `device` (ascending) and the rest.
pub(super) fn split_work(device: &[u32], n_used: usize, ids: &[i32], weights: &[f32]) -> SplitWork {
    let local = |id: i32| {
        u32::try_from(id)
            .ok()
            .and_then(|id| device.binary_search(&id).ok())
    };
    // Per token, its selections on each side: (id, weight), local ids on the stage's.
    let mut here: Vec<Vec<(i32, f32)>> = Vec::new();
    let mut there: Vec<(usize, Vec<(i32, f32)>)> = Vec::new();
    for (t, (row, wrow)) in ids
        .chunks_exact(n_used)
        .zip(weights.chunks_exact(n_used))
        .enumerate()
    {
        let (mut h, mut r) = (Vec::new(), Vec::new());
        for (&id, &w) in row.iter().zip(wrow) {
            match local(id) {
                Some(l) => h.push((l as i32, w)),
                None => r.push((id, w)),
            }
        }
        here.push(h);
        if !r.is_empty() {
            there.push((t, r));
        }
    }
    let (dev_width, dev_ids, dev_weights) = pad(here.iter().map(|h| &h[..]));
    let (width, ids, weights) = pad(there.iter().map(|(_, r)| &r[..]));
    SplitWork {
        dev_width,
        dev_ids,
        dev_weights,
        rows: there.iter().map(|(t, _)| *t).collect(),
        width,
        ids,
        weights,
    }
}

/// Lays out one side's rows as `[n_rows][width]` ids and weights, `width`
/// the longest row, filling each shorter row with ids of other rows it
/// does not hold (there are always enough: the longest row alone has
/// `width` of them), weight 0.
pub(super) fn pad<'a>(
    rows: impl Iterator<Item = &'a [(i32, f32)]> + Clone,
) -> (usize, Vec<i32>, Vec<f32>) {
    let width = rows.clone().map(<[_]>::len).max().unwrap_or(0);
    let mut pool: Vec<i32> = Vec::new();
    for &(id, _) in rows.clone().flatten() {
        if !pool.contains(&id) {
            pool.push(id);
        }
    }
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in rows {
        ids.extend(row.iter().map(|&(id, _)| id));
        weights.extend(row.iter().map(|&(_, w)| w));
        let stand_ins = pool
            .iter()
            .filter(|&&p| !row.iter().any(|&(id, _)| id == p))
            .take(width - row.len());
        for &p in stand_ins {
            ids.push(p);
            weights.push(0.0);
        }
    }
    (width, ids, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_work_gives_each_side_its_experts_and_distinct_weight_0_stand_ins() {
        // Two experts per token; experts 2 and 5 (local 0 and 1) are kept on the stage.
        let ids = [5, 1, 3, 7, 2, 5, 0, 2];
        let w = [0.6, 0.4, 0.7, 0.3, 0.8, 0.2, 0.9, 0.1];
        let s = split_work(&[2, 5], 2, &ids, &w);
        assert_eq!(s.dev_width, 2);
        assert_eq!(s.dev_ids, [1, 0, 1, 0, 0, 1, 0, 1]);
        assert_eq!(s.dev_weights, [0.6, 0.0, 0.0, 0.0, 0.8, 0.2, 0.1, 0.0]);
        // Token 2 has nothing elsewhere.
        assert_eq!((s.rows, s.width), (vec![0, 1, 3], 2));
        assert_eq!(s.ids, [1, 3, 3, 7, 0, 1]);
        assert_eq!(s.weights, [0.4, 0.0, 0.7, 0.3, 0.9, 0.0]);
        // One token (a decode step): no stand-ins at all.
        let s = split_work(&[2, 5], 2, &ids[..2], &w[..2]);
        assert_eq!(
            (s.dev_width, s.dev_ids, s.dev_weights),
            (1, vec![1], vec![0.6])
        );
        assert_eq!((s.width, s.ids, s.weights), (1, vec![1], vec![0.4]));
        let none = split_work(&[], 2, &ids, &w);
        assert_eq!(none.dev_width, 0);
        assert_eq!(
            (none.rows, none.ids, none.weights),
            (vec![0, 1, 2, 3], ids.to_vec(), w.to_vec())
        );
        let all = split_work(&[0, 1, 2, 3, 5, 7], 2, &ids, &w);
        assert!(all.rows.is_empty() && all.width == 0 && all.dev_weights == w);
    }

    #[test]
    fn split_work_keeps_every_selection_once_and_ids_distinct() {
        let (n_expert, n_used, n) = (16u32, 4, 40);
        // Top-k style rows: distinct ids, positive weights.
        let mut ids = Vec::new();
        for t in 0..n {
            let mut row: Vec<i32> = Vec::new();
            let mut k = t * 7 + 3;
            while row.len() < n_used {
                k = (k * 13 + 5) % n_expert as usize;
                if !row.contains(&(k as i32)) {
                    row.push(k as i32);
                }
            }
            ids.extend(row);
        }
        let w: Vec<f32> = (0..ids.len())
            .map(|i| 0.05 + (i % 5) as f32 * 0.1)
            .collect();
        for device in [vec![0], vec![3, 9], vec![1, 4, 6, 10, 11, 12, 13, 14, 15]] {
            let s = split_work(&device, n_used, &ids, &w);
            assert!(s.dev_width <= n_used && s.width <= n_used);
            let mut seen = vec![Vec::new(); n];
            for (t, (row, wrow)) in s
                .dev_ids
                .chunks(s.dev_width.max(1))
                .zip(s.dev_weights.chunks(s.dev_width.max(1)))
                .enumerate()
                .take(if s.dev_width == 0 { 0 } else { n })
            {
                let mut d = row.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), row.len(), "{device:?}: {row:?}");
                for (&l, &wt) in row.iter().zip(wrow) {
                    if wt != 0.0 {
                        seen[t].push((device[l as usize] as i32, wt.to_bits()));
                    }
                }
            }
            for (i, &t) in s.rows.iter().enumerate() {
                let row = &s.ids[i * s.width..(i + 1) * s.width];
                let mut d = row.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), row.len(), "{device:?}: {row:?}");
                assert!(row.iter().all(|&id| !device.contains(&(id as u32))));
                for (&id, &wt) in row.iter().zip(&s.weights[i * s.width..]) {
                    if wt != 0.0 {
                        seen[t].push((id, wt.to_bits()));
                    }
                }
            }
            for (t, mut got) in seen.into_iter().enumerate() {
                let mut want: Vec<(i32, u32)> = (0..n_used)
                    .map(|j| (ids[t * n_used + j], w[t * n_used + j].to_bits()))
                    .collect();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "{device:?} token {t}");
            }
        }
    }
}
