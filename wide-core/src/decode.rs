//! Fixed-shape greedy decoding whose step needs no host values, optionally captured in a CUDA
//! graph: every buffer is preallocated, the step advances its own position, slot and mask on
//! the device, so steps run back to back with no host synchronisation.
use crate::model::{ForwardOptions, KvCache, LlamaModel, Logits};
use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};
use wide_kernels::CudaGraph;

pub struct StaticDecoder<'m> {
    model: &'m LlamaModel,
    pub cache: KvCache,
    /// `[B, 1]`: the token each row feeds next; the step overwrites it with its prediction.
    pub tokens: Tensor,
    positions: Tensor,
    slot: Tensor,
    key_valid: Tensor,
    graph: Option<CudaGraph>,
}

impl<'m> StaticDecoder<'m> {
    /// Prefills `prompt_ids: [B, T]` (no padding) into a cache of `capacity` slots and
    /// prepares the first decode step. `use_graph` captures the step in a CUDA graph.
    pub fn new(model: &'m LlamaModel, prompt_ids: &Tensor, capacity: i64, use_graph: bool) -> Result<Self> {
        let _g = tch::no_grad_guard();
        let (b, t) = prompt_ids.size2()?;
        ensure!(t < capacity, "cache capacity {capacity} leaves no room after a {t}-token prompt");
        let dev = model.device;
        let mut cache = KvCache::new(&model.config, b, capacity, model.kind, dev);
        let logits = model.forward(&prompt_ids.to_device(dev), ForwardOptions { cache: Some(&mut cache), logits: Some(Logits::Last), ..Default::default() })?;
        let tokens = logits.squeeze_dim(1).argmax(-1, true);
        let positions = Tensor::full([b, 1], t, (Kind::Int64, dev));
        let slot = Tensor::full([1], t, (Kind::Int64, dev));
        let key_valid = Tensor::zeros([b, capacity], (Kind::Bool, dev));
        let _ = key_valid.narrow(1, 0, t).fill_(1);
        let mut d = Self { model, cache, tokens, positions, slot, key_valid, graph: None };
        if use_graph && matches!(dev, Device::Cuda(_)) {
            d.capture()?;
        }
        Ok(d)
    }

    /// The step body: mark the slot valid, run the model, write the prediction into `tokens`,
    /// advance position and slot.
    fn step_body(&self) {
        let mut valid = self.key_valid.shallow_clone();
        let _ = valid.index_fill_(1, &self.slot, 1);
        let logits = self.model.decode_static(&self.tokens, &self.positions, &self.slot, &self.key_valid, &self.cache);
        let next = logits.argmax(-1, true);
        self.tokens.shallow_clone().copy_(&next);
        let _ = self.positions.shallow_clone().g_add_scalar_(1);
        let _ = self.slot.shallow_clone().g_add_scalar_(1);
    }

    fn capture(&mut self) -> Result<()> {
        let device = match self.model.device {
            Device::Cuda(d) => d,
            _ => unreachable!(),
        };
        // Warm up outside the capture (library handles, workspaces), then restore the state.
        let saved = (self.tokens.copy(), self.positions.copy(), self.slot.copy(), self.key_valid.copy());
        self.step_body();
        self.tokens.shallow_clone().copy_(&saved.0);
        self.positions.shallow_clone().copy_(&saved.1);
        self.slot.shallow_clone().copy_(&saved.2);
        self.key_valid.shallow_clone().copy_(&saved.3);
        let mut g = CudaGraph::new(device)?;
        g.capture(|| {
            self.step_body();
            Ok(())
        })?;
        self.graph = Some(g);
        Ok(())
    }

    /// Runs one step (a graph replay when captured). The new tokens are in `self.tokens`.
    pub fn step(&mut self) -> Result<()> {
        let _g = tch::no_grad_guard();
        ensure!(self.cache.len < self.cache.capacity, "decoder cache is full ({} slots)", self.cache.capacity);
        match &self.graph {
            Some(g) => g.replay()?,
            None => self.step_body(),
        }
        self.cache.len += 1;
        Ok(())
    }
}
