//! What a WIDE model is: Hugging Face configs, checkpoints and tokenizers, the Llama-family
//! backbone (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3) with its KV cache and generation.
//! Routers, gates and the routing variants build on this one forward path.
pub mod checkpoint;
pub mod config;
pub mod decode;
pub mod generate;
pub mod infer;
pub mod lora;
pub mod model;
pub mod presets;
pub mod pretrained;
pub mod rope;
pub mod routing;
pub mod safetensors;
pub mod tokenizer;

pub use checkpoint::{save_hf_folder, HfCheckpoint, RandomWeights, SaveOptions, WeightSource};
pub use config::{Family, ModelConfig, RopeScaling};
pub use generate::{Generation, SamplingConfig};
pub use model::{ForwardOptions, KvCache, LlamaModel, Logits};
pub use tokenizer::Tokenizer;
pub use pretrained::{parse_device, parse_dtype, Pretrained};
#[cfg(test)]
mod routing_forward_tests;
