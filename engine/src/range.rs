//! A layer range: which part of a model a stage runs (optionally the
//! embedding, layers `a..b`, optionally the head). The planner splits a model
//! into these and every stage runs one.

use std::ops::Range;

use crate::error::EngineError;

/// Which part of the model a stage runs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRange {
    pub embed: bool,
    pub layers: Range<u32>,
    pub head: bool,
}

impl LayerRange {
    pub fn whole(n_layer: u32) -> LayerRange {
        LayerRange {
            embed: true,
            layers: 0..n_layer,
            head: true,
        }
    }

    /// Splits `0..n_layer` into contiguous ranges of the given sizes; the
    /// first gets the embedding, the last the head.
    pub fn split(n_layer: u32, sizes: &[u32]) -> Result<Vec<LayerRange>, EngineError> {
        if sizes.is_empty() || sizes.iter().sum::<u32>() != n_layer {
            return Err(EngineError::Config(format!(
                "layer split {sizes:?} does not add up to the model's {n_layer} layers"
            )));
        }
        let mut start = 0;
        let n = sizes.len();
        Ok(sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let r = LayerRange {
                    embed: i == 0,
                    layers: start..start + s,
                    head: i == n - 1,
                };
                start += s;
                r
            })
            .collect())
    }

    #[cfg(feature = "ggml")]
    pub(crate) fn validate(&self, n_layer: u32) -> Result<(), EngineError> {
        if self.layers.start > self.layers.end || self.layers.end > n_layer {
            return Err(EngineError::Config(format!(
                "layers {}-{} are outside the model's layers 0-{}",
                self.layers.start,
                self.layers.end.saturating_sub(1),
                n_layer.saturating_sub(1)
            )));
        }
        if self.layers.is_empty() && !self.embed && !self.head {
            return Err(EngineError::Config(
                "an empty layer range with neither embedding nor head does nothing".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let layers = match self.layers.len() {
            0 => String::new(),
            1 => format!("layer {}", crate::fmt_layers(&self.layers)),
            _ => format!("layers {}", crate::fmt_layers(&self.layers)),
        };
        let parts: Vec<&str> = [
            self.embed.then_some("embed"),
            Some(layers.as_str()),
            self.head.then_some("head"),
        ]
        .into_iter()
        .flatten()
        .filter(|p| !p.is_empty())
        .collect();
        write!(f, "{}", parts.join(" + "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_all_layers() {
        let r = LayerRange::split(18, &[6, 6, 6]).unwrap();
        assert_eq!(
            r[0],
            LayerRange {
                embed: true,
                layers: 0..6,
                head: false
            }
        );
        assert_eq!(
            r[2],
            LayerRange {
                embed: false,
                layers: 12..18,
                head: true
            }
        );
        assert!(LayerRange::split(18, &[6, 6])
            .unwrap_err()
            .to_string()
            .contains("18"));
    }
}
