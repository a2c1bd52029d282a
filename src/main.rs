//! `wide`: the one command-line program of the project.
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{nn, Kind};
use wide_core::checkpoint::{kind_name, save_hf_folder, SaveOptions};
use wide_core::tokenizer::TextStream;
use wide_core::routing::Variant;
use wide_core::{parse_device, parse_dtype, presets, LlamaModel, Pretrained, RandomWeights, SamplingConfig};

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("WIDE_GIT_COMMIT"), ")");

/// Token-level dynamic width pruning (WIDE) for Llama-family language models.
#[derive(Parser)]
#[command(name = "wide", version = VERSION, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a Hugging Face model folder: architecture, parameters, routable group sizes.
    Info {
        model_dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Also load every weight (checking names and shapes) and report load time and peak
        /// host memory.
        #[arg(long)]
        load: bool,
        /// Device for --load: auto, cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Dtype for --load: auto, f32, bf16 or f16.
        #[arg(long, default_value = "auto")]
        dtype: String,
    },
    /// Generate text from a model folder, streaming tokens as they are produced.
    Generate(GenerateArgs),
    /// Write a random-weight model of a built-in shape as a Hugging Face folder.
    NewModel {
        /// Model shape: tiny (byte-level vocabulary, for tests and the demo) or llama-3.1-8b.
        #[arg(long, default_value = "tiny")]
        preset: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Stored dtype: f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Replace an existing output folder.
        #[arg(long)]
        overwrite: bool,
    },
    /// Run a wide subcommand data-parallel, one process per GPU: `wide launch --nproc-per-node 2
    /// -- calibrate --config RECIPE`. Each process gets RANK, LOCAL_RANK, WORLD_SIZE,
    /// MASTER_ADDR and MASTER_PORT (any launcher that sets them, or Slurm's srun, works too).
    Launch {
        /// Processes (GPUs) on this machine.
        #[arg(long, default_value_t = 1)]
        nproc_per_node: usize,
        /// Machines taking part (run `wide launch` on each, with its --node-rank).
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Address of the machine of rank 0 (reachable from every machine).
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// Port rank 0 listens on (default: a free port on one machine, 29500 on several).
        #[arg(long)]
        master_port: Option<u16>,
        /// Seconds the other ranks get to stop after one fails, before they are killed.
        #[arg(long, default_value_t = 30)]
        grace_seconds: u64,
        /// The wide subcommand and its arguments, after `--`.
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// The main job on the embedded default (CPU, from nothing): build the corpus and tokenizer,
    /// train testbed-tiny, and compare wide against dynamic depth pruning and the other
    /// variants at 50% sparsity.
    Demo {
        /// Working folder for the models the demo builds.
        #[arg(long, default_value = "target/demo")]
        workdir: PathBuf,
    },
    /// Build a text corpus folder (train/validation/test JSONL + manifest) from the Debian
    /// documentation packages and/or your own .txt/.md/.rst/.jsonl files and folders.
    Corpus {
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// `debian-docs` and/or paths; repeatable.
        #[arg(long = "source", default_value = "debian-docs")]
        sources: Vec<String>,
        #[arg(long, default_value_t = 0.02)]
        validation_fraction: f64,
        #[arg(long, default_value_t = 0.02)]
        test_fraction: f64,
    },
    /// Train a byte-level BPE tokenizer on a corpus folder's training split.
    Tokenizer {
        #[arg(long)]
        corpus: PathBuf,
        #[arg(long, default_value_t = 8192)]
        vocab_size: usize,
        /// Output tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
    /// Stage 0: train a testbed model from scratch from a TOML recipe (corpus, tokenizer and
    /// token files are built and cached as needed) and write it as a Hugging Face folder.
    Pretrain {
        #[arg(long)]
        config: PathBuf,
        /// Override a recipe field: `--set train.lr=1e-3` (repeatable).
        #[arg(long = "set")]
        overrides: Vec<String>,
        /// Continue from the latest checkpoint in the output folder.
        #[arg(long)]
        resume: bool,
        /// Only build the corpus, tokenizer and token files (e.g. on a CPU node), then stop.
        #[arg(long)]
        prepare_only: bool,
    },
    /// Stage 1: calibrate routers on a frozen model (or choose static_width groups) from a
    /// TOML recipe; writes routers.safetensors and the routing manifest routing.json.
    Calibrate {
        #[arg(long)]
        config: PathBuf,
        /// Override a recipe field: `--set routing.target_sparsity=0.5` (repeatable).
        #[arg(long = "set")]
        overrides: Vec<String>,
        #[arg(long)]
        resume: bool,
    },
    /// Stage 2: LoRA recovery on top of a stage 1 folder (LoRA + routers, or LoRA only with
    /// --freeze-routers); writes lora.safetensors, routers.safetensors and routing.json.
    Recover {
        #[arg(long)]
        config: PathBuf,
        /// The stage 1 output folder.
        #[arg(long)]
        stage1: Option<PathBuf>,
        #[arg(long)]
        freeze_routers: bool,
        #[arg(long = "set")]
        overrides: Vec<String>,
        #[arg(long)]
        resume: bool,
    },
    /// Compare variants at one sparsity: calibrate (or load) wide, sublayer_skip, layer_skip
    /// and static_width with the same recipe and budget, evaluate them next to dense, and
    /// write compare.md/.csv/.json and compare.png.
    Compare {
        /// The stage 1 recipe shared by every variant.
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set")]
        overrides: Vec<String>,
        #[arg(long, default_value_t = 0.5)]
        sparsity: f64,
        #[arg(long, value_delimiter = ',', default_value = "wide,sublayer_skip,layer_skip,static_width")]
        variants: Vec<String>,
        #[arg(long)]
        out: PathBuf,
        /// A stage 2 recipe: also train dense + LoRA and wide + LoRA identically.
        #[arg(long)]
        stage2: Option<PathBuf>,
        /// Held-out split to evaluate on.
        #[arg(long, default_value = "test")]
        split: String,
        /// Multiple-choice task file (JSONL) for acc/acc_norm; default: cloze tasks built from
        /// the evaluation split.
        #[arg(long)]
        tasks: Option<PathBuf>,
    },
    /// Group-granularity sweep of `wide` from a TOML grid (resumable).
    Sweep {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set")]
        overrides: Vec<String>,
    },
    /// Rewrite the tables and charts of a compare.json or sweep.json (e.g. one made on a machine
    /// without fonts) into a folder.
    Replot {
        json: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Plot the loss curves of a training run's metrics.jsonl as a PNG.
    PlotLoss {
        metrics: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "loss")]
        title: String,
    },
    /// Benchmark programs (GPU machine): print a table and write JSON results.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The CUDA kernels: compile them ahead of time for a GPU architecture.
    #[command(subcommand)]
    Kernels(KernelsCommand),
    /// Evaluate models: perplexity, multiple-choice tasks, cloze task building.
    #[command(subcommand)]
    Eval(wide_eval::cli::EvalCommand),
    /// Export a trained model for other runtimes: a Hugging Face folder with the LoRA merged,
    /// the routers (wide_routing.safetensors, wide_routing.json), the LoRA in PEFT's format and,
    /// for static_width, the physically pruned model.
    Export(ExportArgs),
}

#[derive(Args)]
struct ExportArgs {
    /// The Hugging Face model folder the routers were trained on.
    model_dir: PathBuf,
    /// A stage 1 or stage 2 folder (routers.safetensors, routing.json).
    #[arg(long)]
    routers: PathBuf,
    /// A stage 2 folder whose LoRA adapters to use (default: those of --routers, if any).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Output folder (written under a temporary name, renamed when complete).
    #[arg(long)]
    out: PathBuf,
    /// static_width: also write the physically pruned model to OUT/pruned.
    #[arg(long)]
    pruned: bool,
    /// With --pruned: prune skipped attention heads, or zero their o_proj columns.
    #[arg(long, default_value = "prune")]
    pruned_heads: String,
    /// Stored dtype of the weights: auto (that of MODEL_DIR), f32, bf16 or f16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Largest safetensors shard (e.g. 5GB, 500MB).
    #[arg(long, default_value = "5GB")]
    shard_size: String,
    /// base_model_name_or_path of the PEFT adapter (default: MODEL_DIR as given).
    #[arg(long)]
    base_model: Option<String>,
    /// Replace an earlier export at OUT (only once the new one is complete).
    #[arg(long)]
    overwrite: bool,
}

#[derive(Subcommand)]
enum KernelsCommand {
    /// Compile every shipped kernel variant for one GPU architecture into a directory (NVRTC,
    /// no GPU needed). On the GPU machine, `WIDE_KERNEL_CACHE=DIR` then loads them with no
    /// compiler at all; images already in DIR for the same source are kept.
    Precompile {
        /// Target: sm_90 (H100/H200; also builds the Hopper-only sm_90a variants), sm_80, ...;
        /// compute_XY writes PTX instead of machine code.
        #[arg(long, default_value = "sm_90")]
        arch: String,
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Only these kernel families, comma-separated (e.g. infer,routed).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Dense prefill and decode throughput with random weights.
    Dense(DenseArgs),
    /// Routed kernels (gemm_mn, fused gate+up, gemm_k) against cuBLAS dense, cold and warm L2.
    Kernels(KernelsArgs),
    /// Stage 1 (router calibration) training throughput, peak memory and MFU.
    Train(TrainBenchArgs),
    /// Stage 1 throughput on 1, 2, 4, ... GPUs (bench train under `wide launch`): speedup and
    /// scaling efficiency. `wide bench scaling --nproc 1,2 --out F -- --seq-len 4096 ...`
    Scaling(ScalingArgs),
    /// End-to-end prefill and decode of the inference engine: dense against wide at several
    /// sparsities, peak memory, optional per-op device times.
    E2e(E2eArgs),
}

#[derive(Args)]
struct ScalingArgs {
    /// Process (GPU) counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    nproc: Vec<usize>,
    /// Write the results JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Arguments for every `wide bench train`, after `--`.
    #[arg(last = true)]
    train_args: Vec<String>,
}

#[derive(Args)]
struct E2eArgs {
    /// Built-in shape with random weights (ignored with --model-dir).
    #[arg(long, default_value = "llama-3.1-8b")]
    preset: String,
    /// A Hugging Face model folder instead of a random preset.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Trained routers for --model-dir (stage 1/2 folder); random routers without it.
    #[arg(long)]
    routing: Option<PathBuf>,
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, value_delimiter = ',', default_value = "0.3,0.5,0.7")]
    sparsity: Vec<f64>,
    /// Query heads per attention group (random routers).
    #[arg(long, default_value_t = 4)]
    attn_group_size: i64,
    /// Channels per FFN group (random routers).
    #[arg(long, default_value_t = 128)]
    ffn_group_size: i64,
    /// Prompt lengths of the prefill measurements (batch 1); the short one shows the host's
    /// share (each row also prints the host issue time).
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    prefill_tokens: Vec<i64>,
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,32")]
    decode_batches: Vec<i64>,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: i64,
    #[arg(long, default_value_t = 128)]
    new_tokens: i64,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[arg(long, default_value_t = 3)]
    iters: usize,
    #[arg(long)]
    no_cuda_graph: bool,
    /// Also time every op alone (largest prefill, batch-1 decode step).
    #[arg(long)]
    profile: bool,
    /// Measure the cost of these ops inside the captured batch-1 decode step: each is run
    /// twice in turn (embed, norm, qkv, rope_kv, attention, o_proj, gate_up, down, lm_head).
    #[arg(long, value_delimiter = ',')]
    repeat_ops: Vec<String>,
    /// After the rows, time the prefills of dense and every variant again in turn: --iters
    /// rounds of one prefill each, the order rotated each round, so that all run under the same
    /// spread of clock and power states (JSON `prefill_interleaved`).
    #[arg(long)]
    interleave: bool,
    /// With --interleave: idle the device this many milliseconds between two interleaved runs
    /// (to see what a run leaves the next one, such as the power state).
    #[arg(long, default_value_t = 0)]
    interleave_gap_ms: u64,
    /// After the rows, measure dense a model of only the width wide keeps at each --sparsity
    /// (query heads and FFN channels in whole groups; random weights): routing at no cost on
    /// dense's kernels, the ceiling of the routed speedup (rows `kept-width`).
    #[arg(long)]
    kept_width: bool,
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

#[derive(Args)]
struct TrainBenchArgs {
    #[arg(long, default_value = "llama-3.1-8b")]
    preset: String,
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// wide, sublayer_skip or layer_skip.
    #[arg(long, default_value = "wide")]
    variant: String,
    #[arg(long, default_value_t = 0.5)]
    sparsity: f64,
    #[arg(long, default_value_t = 4)]
    attn_group_size: i64,
    #[arg(long, default_value_t = 128)]
    ffn_group_size: i64,
    #[arg(long, default_value_t = 4096)]
    seq_len: i64,
    #[arg(long, default_value_t = 1)]
    micro_batch: i64,
    /// Recompute each layer in the backward pass instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 6)]
    iters: usize,
    /// The bf16 matrix-product ceiling measured on the device (TFLOP/s), for MFU.
    #[arg(long, default_value_t = 790.0)]
    peak_tflops: f64,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct KernelsArgs {
    /// Ops, comma separated: up, gate_up, down, q, o, attn_decode, attn_prefill.
    #[arg(long, value_delimiter = ',', default_value = "up,gate_up,down,q,o,attn_decode")]
    ops: Vec<String>,
    /// KV-cache lengths for attn_decode, prompt lengths for attn_prefill, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,32768")]
    contexts: Vec<i64>,
    /// Token counts M, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,128,1024,4096,16384")]
    m: Vec<i64>,
    /// FFN group sizes, comma separated (q/o always use 512 = 4 heads of 128).
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256")]
    groups: Vec<i64>,
    /// Skip rates, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    sparsity: Vec<f64>,
    /// L2 modes, comma separated: cold (a buffer of twice the L2 written between timed runs,
    /// which leaves the L2 full of dirty lines), cold-clean (the same buffer read instead: clean
    /// lines, as after an inference step's weight reads), warm.
    #[arg(long, value_delimiter = ',', default_value = "cold,warm")]
    l2: Vec<String>,
    /// Masks of the projections: random (each token keeps each group with probability 1 - s),
    /// prefix (every group keeps the same first (1 - s) M tokens: contiguous gathered rows),
    /// random-even (exactly (1 - s) M random tokens a group) or prefix-uneven (each group its
    /// first c tokens, c a random mask's count): diagnostics of what the row gather and uneven
    /// counts cost. Attention ops take random or random-even (exactly (1 - s) of every token's
    /// head groups).
    #[arg(long, default_value = "random")]
    mask_pattern: String,
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// JSON results file.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

#[derive(Args)]
struct GenerateArgs {
    model_dir: PathBuf,
    /// Prompt text; repeat for a batch.
    #[arg(long, required = true)]
    prompt: Vec<String>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// auto (bf16 on GPU, f32 on CPU), f32, bf16 or f16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Routing folder (stage 1 or 2: routers, LoRA, routing.json): generate with its routers.
    #[arg(long)]
    routing: Option<PathBuf>,
    /// Search the routers' inference offsets (one per router kind) on the prompts so that this
    /// share of the groups is skipped, without retraining.
    #[arg(long)]
    sparsity: Option<f64>,
    /// Ignore --routing and run the dense model (for comparison).
    #[arg(long)]
    dense: bool,
    /// Decode without CUDA graph capture.
    #[arg(long)]
    no_cuda_graph: bool,
}

#[derive(Args)]
struct DenseArgs {
    #[arg(long, default_value = "llama-3.1-8b")]
    preset: String,
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Prefill lengths (batch 1), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    prefill_tokens: Vec<i64>,
    /// Decode batch sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,32")]
    decode_batches: Vec<i64>,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: i64,
    #[arg(long, default_value_t = 128)]
    new_tokens: i64,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Decode without CUDA graph capture.
    #[arg(long)]
    no_cuda_graph: bool,
    /// JSON results file.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        let mut stderr = std::io::stderr();
        // One line, whatever the messages underneath contain.
        let msg = format!("{e:#}").split('\n').map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ");
        // In a distributed run, say which process failed.
        let rank = match wide_train::dist::DistEnv::from_env() {
            Ok(Some(d)) if !msg.starts_with("rank ") => format!("rank {}: ", d.rank),
            _ => String::new(),
        };
        let _ = writeln!(stderr, "error: {rank}{msg}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Eval(c) => wide_eval::cli::run(c, env!("WIDE_GIT_COMMIT")),
        Command::Export(a) => export(a),
        Command::Info { model_dir, json, load, device, dtype } => {
            let load = if load {
                let device = parse_device(&device)?;
                Some((device, parse_dtype(&dtype, device)?))
            } else {
                None
            };
            info(&model_dir, json, load)
        }
        Command::Generate(a) => generate(&a),
        Command::NewModel { preset, out, seed, dtype, overwrite } => {
            let kind = parse_dtype(&dtype, tch::Device::Cpu)?;
            new_model(&preset, &out, seed, kind, overwrite)
        }
        Command::Demo { workdir } => demo(&workdir),
        Command::Launch { nproc_per_node, nnodes, node_rank, master_addr, master_port, grace_seconds, args } => wide_train::dist::launch(
            &wide_train::dist::LaunchConfig { nproc_per_node, nnodes, node_rank, master_addr, master_port, grace_seconds },
            &args,
        ),
        Command::Calibrate { config, overrides, resume } => {
            let (recipe, table) = wide_train::calibrate::CalibrationRecipe::load(&config, &overrides)?;
            if recipe.stage1_dir.is_some() {
                bail!("{} names a stage1_dir: that is a stage 2 recipe, run it with `wide recover`", config.display());
            }
            report_calibration(wide_train::calibrate::run(&recipe, &table, resume, provenance())?)
        }
        Command::Recover { config, stage1, freeze_routers, overrides, resume } => {
            let (mut recipe, table) = wide_train::calibrate::CalibrationRecipe::load(&config, &overrides)?;
            if let Some(s) = stage1 {
                recipe.stage1_dir = Some(s);
            }
            recipe.freeze_routers |= freeze_routers;
            if recipe.stage1_dir.is_none() {
                bail!("stage 2 needs the stage 1 folder: pass --stage1 DIR (or set stage1_dir in the recipe)");
            }
            if recipe.lora.is_none() {
                recipe.lora = Some(Default::default());
            }
            report_calibration(wide_train::calibrate::run(&recipe, &table, resume, provenance())?)
        }
        Command::Compare { config, overrides, sparsity, variants, out, stage2, split, tasks } => {
            let variants = variants.iter().map(|v| wide_core::routing::Variant::parse(v)).collect::<Result<Vec<_>>>()?;
            wide_eval::compare::run(&wide_eval::compare::CompareConfig {
                recipe: config,
                overrides,
                sparsity,
                variants,
                out,
                stage2,
                split: wide_train::corpus::Split::parse(&split)?,
                tasks,
                commit: env!("WIDE_GIT_COMMIT").to_string(),
            })?;
            Ok(())
        }
        Command::Sweep { config, overrides } => {
            let cfg = wide_eval::sweep::load(&config, &overrides)?;
            wide_eval::sweep::run(&cfg, env!("WIDE_GIT_COMMIT"))?;
            Ok(())
        }
        Command::Replot { json, out } => {
            let text = std::fs::read_to_string(&json).with_context(|| format!("cannot read {}", json.display()))?;
            if text.contains("\"cells\"") {
                wide_eval::sweep::replot(&json, &out)
            } else if text.contains("\"rows\"") {
                wide_eval::compare::replot(&json, &out)
            } else {
                bail!("{} is neither a compare.json nor a sweep.json", json.display())
            }
        }
        Command::PlotLoss { metrics, out, title } => wide_eval::plots::loss_curve(&metrics, &out, &title),
        Command::Corpus { out, sources, validation_fraction, test_fraction } => {
            let m = wide_train::corpus::build_corpus(
                &wide_train::corpus::sources_from_names(&sources)?,
                wide_train::corpus::SplitFractions { validation: validation_fraction, test: test_fraction },
                &out,
            )?;
            println!("{}", serde_json::to_string_pretty(&m)?);
            Ok(())
        }
        Command::Tokenizer { corpus, vocab_size, out } => {
            let docs = wide_train::corpus::read_split(&corpus, wide_train::corpus::Split::Train)?;
            let t = wide_train::bpe::train_bpe(docs.iter().map(|d| d.text.as_str()), vocab_size, &out)?;
            eprintln!("wrote {} ({} entries)", out.display(), t.vocab_size());
            Ok(())
        }
        Command::Pretrain { config, overrides, resume, prepare_only } => {
            let (recipe, table) = wide_train::pretrain::PretrainRecipe::load(&config, &overrides)?;
            if prepare_only {
                let files = recipe.data.prepare()?;
                println!("{}", files.dir.display());
                return Ok(());
            }
            let Some(report) = wide_train::pretrain::run(&recipe, &table, resume)? else {
                return Ok(());
            };
            let png = recipe.output.dir.join("loss_curve.png");
            wide_eval::plots::loss_curve(&recipe.output.dir.join("metrics.jsonl"), &png, &format!("{} loss", report.name))?;
            eprintln!("loss curve: {}", png.display());
            println!(
                "{}: {} parameters, {} tokens in {:.1}s ({:.0} tokens/s); validation loss {:.4} (perplexity {:.2}), test perplexity {:.2}; bigram {:.2}, unigram {:.2}; model in {}",
                report.name,
                report.parameters,
                report.train.tokens,
                report.train.seconds,
                report.train.tokens_per_second,
                report.validation_loss,
                report.validation_perplexity,
                report.test_perplexity,
                report.baselines.bigram_validation_perplexity,
                report.baselines.unigram_validation_perplexity,
                report.model_dir.display()
            );
            Ok(())
        }
        Command::Kernels(KernelsCommand::Precompile { arch, out, only }) => {
            let list = wide_kernels::ops::precompile_list(&arch, &only)?;
            let t0 = std::time::Instant::now();
            let pb = wide_train::progress::bar(list.len() as u64, "precompile");
            let done = wide_kernels::ops::precompile(list, &out, |p| {
                pb.set_message(p.name);
                pb.inc(1);
            })?;
            pb.finish_and_clear();
            let mut fams: std::collections::BTreeMap<(&str, &str), (usize, u64, usize)> = Default::default();
            for p in &done {
                let e = fams.entry((p.name, p.arch.as_str())).or_default();
                e.0 += 1;
                e.1 += p.bytes;
                e.2 += p.compiled as usize;
            }
            println!("{:<14} {:<8} {:>8} {:>10} {:>9}", "family", "arch", "images", "MiB", "compiled");
            for ((name, a), (n, bytes, compiled)) in &fams {
                println!("{name:<14} {a:<8} {n:>8} {:>10.1} {compiled:>9}", *bytes as f64 / (1 << 20) as f64);
            }
            let total: u64 = done.iter().map(|p| p.bytes).sum();
            println!(
                "{} images, {:.1} MiB in {} ({} compiled, {:.1} s); use them with WIDE_KERNEL_CACHE={}",
                done.len(),
                total as f64 / (1 << 20) as f64,
                out.display(),
                done.iter().filter(|p| p.compiled).count(),
                t0.elapsed().as_secs_f64(),
                out.display()
            );
            Ok(())
        }
        Command::Bench(BenchCommand::Kernels(a)) => {
            let device = parse_device(&a.device)?;
            let kind = parse_dtype(&a.dtype, device)?;
            wide_eval::bench::kernels::run(&wide_eval::bench::kernels::KernelBenchConfig {
                ops: a.ops,
                contexts: a.contexts,
                m: a.m,
                groups: a.groups,
                sparsity: a.sparsity,
                l2: a.l2,
                mask_pattern: a.mask_pattern.parse()?,
                warmup: a.warmup,
                iters: a.iters,
                device,
                kind,
                out: a.out,
                commit: env!("WIDE_GIT_COMMIT").to_string(),
                seed: a.seed,
            })
            .map(|_| ())
        }
        Command::Bench(BenchCommand::Scaling(a)) => wide_eval::bench::scaling::run(&wide_eval::bench::scaling::ScalingConfig {
            nprocs: a.nproc,
            train_args: a.train_args,
            out: a.out,
            commit: env!("WIDE_GIT_COMMIT").to_string(),
        })
        .map(|_| ()),
        Command::Bench(BenchCommand::Train(a)) => {
            // Under `wide launch`, each process trains on its own GPU.
            let device = wide_train::dist::init()?.device(parse_device(&a.device)?)?;
            let kind = parse_dtype(&a.dtype, device)?;
            wide_core::routing::check_sparsity(a.sparsity)?;
            wide_eval::bench::train::run(&wide_eval::bench::train::TrainBenchConfig {
                preset: a.preset,
                device,
                kind,
                variant: wide_core::routing::Variant::parse(&a.variant)?,
                sparsity: a.sparsity,
                attn_group_size: a.attn_group_size,
                ffn_group_size: a.ffn_group_size,
                seq_len: a.seq_len,
                micro_batch: a.micro_batch,
                activation_checkpointing: a.activation_checkpointing,
                warmup: a.warmup,
                iters: a.iters,
                peak_tflops: a.peak_tflops,
                out: a.out,
                commit: env!("WIDE_GIT_COMMIT").to_string(),
            })?;
            Ok(())
        }
        Command::Bench(BenchCommand::E2e(a)) => {
            let device = parse_device(&a.device)?;
            let kind = parse_dtype(&a.dtype, device)?;
            for s in &a.sparsity {
                wide_core::routing::check_sparsity(*s)?;
            }
            anyhow::ensure!(a.interleave || a.interleave_gap_ms == 0, "--interleave-gap-ms applies to the interleaved prefills: add --interleave");
            wide_eval::bench::e2e::run(&wide_eval::bench::e2e::E2eBenchConfig {
                preset: a.preset,
                model_dir: a.model_dir,
                routing_dir: a.routing,
                device,
                kind,
                sparsities: a.sparsity,
                attn_group_size: a.attn_group_size,
                ffn_group_size: a.ffn_group_size,
                prefill_tokens: a.prefill_tokens,
                decode_batches: a.decode_batches,
                prompt_tokens: a.prompt_tokens,
                new_tokens: a.new_tokens,
                warmup: a.warmup,
                iters: a.iters,
                cuda_graph: !a.no_cuda_graph,
                profile: a.profile,
                repeat_ops: a.repeat_ops,
                interleave: a.interleave,
                interleave_gap_ms: a.interleave_gap_ms,
                kept_width: a.kept_width,
                out: a.out,
                commit: env!("WIDE_GIT_COMMIT").to_string(),
                seed: a.seed,
            })?;
            Ok(())
        }
        Command::Bench(BenchCommand::Dense(a)) => {
            let device = parse_device(&a.device)?;
            let kind = parse_dtype(&a.dtype, device)?;
            wide_eval::bench::dense::run(&wide_eval::bench::dense::DenseBenchConfig {
                preset: a.preset,
                device,
                kind,
                prefill_tokens: a.prefill_tokens,
                decode_batches: a.decode_batches,
                prompt_tokens: a.prompt_tokens,
                new_tokens: a.new_tokens,
                warmup: a.warmup,
                iters: a.iters,
                cuda_graph: !a.no_cuda_graph,
                out: a.out,
                commit: env!("WIDE_GIT_COMMIT").to_string(),
                seed: a.seed,
            })?;
            Ok(())
        }
    }
}

fn provenance() -> serde_json::Value {
    serde_json::json!({"commit": env!("WIDE_GIT_COMMIT"), "version": env!("CARGO_PKG_VERSION"), "command": std::env::args().collect::<Vec<_>>().join(" ")})
}

fn export(a: ExportArgs) -> Result<()> {
    use wide_train::export::{parse_size, HeadPruning};
    let dtype = match a.dtype.as_str() {
        "auto" => None,
        d => Some(parse_dtype(d, tch::Device::Cpu)?),
    };
    let cfg = wide_train::export::ExportConfig {
        model_dir: a.model_dir,
        routers: a.routers,
        lora: a.lora,
        out: a.out,
        pruned: a.pruned,
        pruned_heads: HeadPruning::parse(&a.pruned_heads)?,
        dtype,
        max_shard_bytes: parse_size(&a.shard_size)?,
        base_model: a.base_model,
        overwrite: a.overwrite,
        provenance: provenance(),
    };
    let r = wide_train::export::run(&cfg)?;
    if let Some(p) = &r.pruned {
        if p.kv_heads_duplicated {
            eprintln!("note: layers keep different numbers of query heads per KV group, so the pruned model repeats some KV heads ({} KV heads)", p.num_key_value_heads);
        }
    }
    let pruned = r.pruned.as_ref().map(|p| {
        format!(
            "; pruned model: {} heads, {} KV heads, intermediate {} ({} of {} parameters)",
            p.num_attention_heads, p.num_key_value_heads, p.intermediate_size, p.parameters, p.dense_parameters
        )
    });
    println!(
        "exported {} ({} router tensors, {} LoRA modules merged{}) to {} ({:.1} MB)",
        r.variant,
        r.routed_tensors,
        r.lora_modules,
        pruned.unwrap_or_default(),
        r.out.display(),
        r.bytes as f64 / 1e6
    );
    Ok(())
}

fn report_calibration(r: Option<wide_train::calibrate::CalibrationReport>) -> Result<()> {
    let Some(r) = r else { return Ok(()) };
    let rates: Vec<String> = r.heldout.sparsity.skip_rate.iter().map(|(k, v)| format!("{k} {v:.3}")).collect();
    println!(
        "{} (stage {}, {}): held-out loss {:.4} (perplexity {:.2}); skip rates {}; executed FLOPs {:.3} of dense; written to {}",
        r.name,
        r.stage,
        r.variant,
        r.heldout.loss,
        r.heldout.perplexity,
        rates.join(", "),
        r.heldout.sparsity.flops_fraction,
        r.output_dir.display()
    );
    Ok(())
}

fn info(dir: &Path, as_json: bool, load: Option<(tch::Device, Kind)>) -> Result<()> {
    let ckpt = wide_core::HfCheckpoint::open(dir)?;
    let c = &ckpt.config;
    let loaded = match load {
        Some((device, kind)) => {
            let t0 = std::time::Instant::now();
            let p = Pretrained::load(dir, device, kind)?;
            let secs = t0.elapsed().as_secs_f64();
            let n: i64 = p.vs.variables().values().map(|t| t.numel() as i64).sum();
            Some(serde_json::json!({"device": format!("{device:?}"), "dtype": kind_name(kind), "seconds": secs,
                "tensors": p.vs.variables().len(), "parameters_loaded": n, "peak_rss_bytes": peak_rss_bytes()}))
        }
        None => None,
    };
    let v = serde_json::json!({
        "model_dir": dir.display().to_string(),
        "family": c.family.model_type(),
        "parameters": c.parameter_count(),
        "stored_dtype": ckpt.stored_kind().map(kind_name),
        "checkpoint_bytes": ckpt.data_bytes(),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "layers": c.num_hidden_layers,
        "attention_heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "context": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "tied_embeddings": c.tie_word_embeddings,
        "sliding_window": c.sliding_window.iter().flatten().next(),
        "eos_token_ids": c.eos_token_ids,
        "attention_group_sizes": c.attention_group_sizes(),
        "ffn_group_sizes": c.ffn_group_sizes(),
        "tokenizer": ckpt.tokenizer_path().is_some(),
        "load": loaded,
    });
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("model        {}", dir.display());
    println!("family       {} ({})", c.family.model_type(), c.family.architecture());
    println!("parameters   {} ({:.3}B)", c.parameter_count(), c.parameter_count() as f64 / 1e9);
    println!("stored as    {} ({:.1} MB)", v["stored_dtype"].as_str().unwrap_or("?"), ckpt.data_bytes() as f64 / 1e6);
    println!("layers       {}  hidden {}  intermediate {}  vocab {}", c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size);
    println!("attention    {} query heads, {} KV heads, head_dim {}", c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    println!("rope         theta {} {:?}  context {}", c.rope_theta, c.rope_scaling, c.max_position_embeddings);
    if let Some(w) = c.sliding_window.iter().flatten().next() {
        println!("sliding      window {w}");
    }
    println!("embeddings   {}", if c.tie_word_embeddings { "tied" } else { "untied" });
    println!("eos ids      {:?}", c.eos_token_ids);
    println!("tokenizer    {}", if ckpt.tokenizer_path().is_some() { "tokenizer.json" } else { "none" });
    println!("routable attention group sizes (heads per group): {:?}", c.attention_group_sizes());
    println!("routable FFN group sizes (channels per group):    {:?}", c.ffn_group_sizes());
    if let Some(l) = &v["load"].as_object() {
        println!(
            "loaded       {} tensors to {} as {} in {:.2}s; peak host memory {:.1} MB",
            l["tensors"], l["device"].as_str().unwrap_or(""), l["dtype"].as_str().unwrap_or(""),
            l["seconds"].as_f64().unwrap_or(0.0), l["peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1e6
        );
    }
    Ok(())
}

/// Peak resident memory of this process (VmHWM), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn generate(a: &GenerateArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let kind = parse_dtype(&a.dtype, device)?;
    if a.temperature < 0.0 || !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--temperature must be >= 0 and --top-p in (0, 1]");
    }
    if let Some(s) = a.sparsity {
        wide_core::routing::check_sparsity(s)?;
        if a.routing.is_none() || a.dense {
            bail!("--sparsity needs --routing DIR (trained routers whose offsets are searched) and no --dense");
        }
    }
    let t0 = std::time::Instant::now();
    let routing_dir = a.routing.as_deref().filter(|_| !a.dense);
    let mut rm = match routing_dir {
        Some(r) => wide_train::calibrate::RoutedModel::load(&a.model_dir, r, device, kind)?,
        None => wide_train::calibrate::RoutedModel::new(&a.model_dir, &wide_core::routing::RoutingConfig::new(Variant::Dense), device, kind)?,
    };
    if rm.lora.is_some() {
        wide_core::lora::Lora::merge(&mut rm.pretrained.model);
    }
    let tok = rm.pretrained.tokenizer.as_ref().with_context(|| format!("{} has no tokenizer.json, which generate needs", a.model_dir.display()))?;
    let prompts: Vec<Vec<i64>> = a.prompt.iter().map(|s| tok.encode(s, true)).collect::<Result<_>>()?;
    rm.pretrained.model.check_context(&prompts, a.max_new_tokens)?;
    let variant = rm.routing.config.variant;
    let mut engine = wide_core::infer::Engine::new(&rm.pretrained.model, Some(&rm.routing))?;
    eprintln!("loaded {} ({}) on {:?} ({:?}) in {:.1}s", a.model_dir.display(), variant.name(), device, kind, t0.elapsed().as_secs_f64());
    if let Some(s) = a.sparsity {
        let b = prompts.len() as i64;
        let t = prompts.iter().map(|p| p.len()).max().unwrap_or(1) as i64;
        let pad = rm.pretrained.model.config.eos_token_ids.first().copied().unwrap_or(0);
        let ids: Vec<i64> = prompts.iter().flat_map(|p| p.iter().copied().chain(std::iter::repeat_n(pad, t as usize - p.len()))).collect();
        let lengths: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
        let got = engine.search_offsets(&tch::Tensor::from_slice(&ids).view([b, t]), &lengths, s)?;
        let o = engine.offsets()[0];
        let rates: Vec<String> = got.per_kind.keys().map(|k| format!("{k} {:.3}", got.rate(k).unwrap_or(0.0))).collect();
        eprintln!("offsets for sparsity {s}: attention {:.4}, ffn {:.4}, layer {:.4}; skip rates on the prompts: {}", o[0], o[1], o[2], rates.join(", "));
    }
    let cfg = SamplingConfig {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        stop_at_eos: !a.ignore_eos,
    };
    let single = prompts.len() == 1;
    let mut stream = TextStream::new();
    let mut out = std::io::stdout();
    if single {
        print!("{}", a.prompt[0]);
        out.flush()?;
    }
    let gen = engine.generate(&prompts, &cfg, !a.no_cuda_graph, |_row, id| {
        if single {
            print!("{}", stream.push(tok, id)?);
            std::io::stdout().flush()?;
        }
        Ok(())
    })?;
    if single {
        println!();
    } else {
        for (prompt, ids) in a.prompt.iter().zip(&gen.tokens) {
            println!("{prompt}{}", tok.decode(ids, true)?);
            println!("---");
        }
    }
    let n: usize = gen.tokens.iter().map(|t| t.len()).sum();
    let prompt_tokens: usize = prompts.iter().map(|p| p.len()).sum();
    // The first new token of each prompt comes from the prefill; the decode steps made the rest
    // (rows that stopped at EOS add none). Their time includes the CUDA graph's capture, if any.
    let decoded = n.saturating_sub(gen.tokens.iter().filter(|t| !t.is_empty()).count());
    eprintln!(
        "prefill {prompt_tokens} tokens in {:.1} ms; {n} new tokens, {decoded} of them by {} decode steps in {:.2} s ({:.1} tokens/s{})",
        gen.prefill_seconds * 1e3,
        gen.decode_steps,
        gen.decode_seconds,
        if gen.decode_seconds > 0.0 { decoded as f64 / gen.decode_seconds } else { 0.0 },
        if gen.graph_captured { ", CUDA graph capture included" } else { "" }
    );
    if engine.is_routed() {
        let fmt = |c: &wide_core::infer::SkipCounts| c.per_kind.keys().map(|k| format!("{k} {:.3}", c.rate(k).unwrap_or(0.0))).collect::<Vec<_>>().join(", ");
        eprintln!("skip rates: prefill {}; decode {}", fmt(&gen.prefill_skip), fmt(&gen.decode_skip));
    }
    Ok(())
}

fn new_model(preset: &str, out: &Path, seed: i64, kind: Kind, overwrite: bool) -> Result<()> {
    let cfg = presets::preset(preset)?;
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _model = LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.02 }, Kind::Float, false)?;
    let mut tensors: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let tok_dir = tempfile::tempdir().context("creating a temporary folder for the tokenizer")?;
    let tok_file;
    let tokenizer = if preset == "tiny" {
        tok_file = tok_dir.path().join("tokenizer.json");
        presets::byte_level_tokenizer()?.save(&tok_file)?;
        Some(tok_file.as_path())
    } else {
        None
    };
    save_hf_folder(out, &cfg, &tensors, &SaveOptions { tokenizer, overwrite, dtype: Some(kind), ..Default::default() })?;
    eprintln!("wrote {} ({} parameters, {}) to {}", preset, cfg.parameter_count(), kind_name(kind), out.display());
    Ok(())
}

/// The embedded default recipes of the demo (the same files as in configs/).
const DEMO_PRETRAIN: &str = include_str!("../configs/testbed-tiny.toml");
const DEMO_CALIBRATE: &str = include_str!("../configs/calibrate-testbed-tiny.toml");

/// The main job on CPU, from nothing: build the Debian-docs corpus and a BPE tokenizer, train
/// testbed-tiny, calibrate every variant at 50% sparsity with the same budget, evaluate them
/// against dense and print the table and the chart's path. Finished steps are reused.
fn demo(workdir: &Path) -> Result<()> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let w = workdir.canonicalize()?;
    let data = [
        format!("data.corpus_dir=\"{}\"", w.join("data/corpus").display()),
        format!("data.tokenizer=\"{}\"", w.join("data/tokenizer-4096.json").display()),
        format!("data.token_cache=\"{}\"", w.join("data/tokens").display()),
    ];
    let pre = w.join("testbed-tiny.toml");
    std::fs::write(&pre, DEMO_PRETRAIN)?;
    let cal = w.join("calibrate-testbed-tiny.toml");
    std::fs::write(&cal, DEMO_CALIBRATE)?;
    let run_dir = w.join("testbed-tiny");
    let model_dir = run_dir.join("model");
    if model_dir.join("config.json").exists() && run_dir.join("summary.json").exists() {
        eprintln!("== [1/2] testbed-tiny already trained in {}: reusing it", run_dir.display());
    } else {
        eprintln!("== [1/2] building the corpus and tokenizer, and training testbed-tiny from scratch (a few minutes on 2 cores)");
        let mut ov: Vec<String> = data.to_vec();
        ov.push(format!("output.dir=\"{}\"", run_dir.display()));
        let (recipe, table) = wide_train::pretrain::PretrainRecipe::load(&pre, &ov)?;
        let resume = wide_train::trainer::latest_checkpoint(&run_dir).is_some();
        let Some(r) = wide_train::pretrain::run(&recipe, &table, resume)? else {
            bail!("training was interrupted; run the demo again to continue");
        };
        wide_eval::plots::loss_curve(&run_dir.join("metrics.jsonl"), &run_dir.join("loss_curve.png"), "testbed-tiny loss")?;
        eprintln!(
            "   testbed-tiny: {} parameters, validation perplexity {:.1} (bigram {:.1}, unigram {:.1})",
            r.parameters, r.validation_perplexity, r.baselines.bigram_validation_perplexity, r.baselines.unigram_validation_perplexity
        );
    }
    eprintln!("== [2/2] wide compare at sparsity 0.5: every variant calibrated with the same recipe and token budget, evaluated against dense");
    let mut ov: Vec<String> = data.to_vec();
    ov.push(format!("model_dir=\"{}\"", model_dir.display()));
    wide_eval::compare::run(&wide_eval::compare::CompareConfig {
        recipe: cal,
        overrides: ov,
        sparsity: 0.5,
        variants: vec![Variant::Wide, Variant::SublayerSkip, Variant::LayerSkip, Variant::StaticWidth],
        out: w.join("compare"),
        stage2: None,
        split: wide_train::corpus::Split::Test,
        tasks: None,
        commit: env!("WIDE_GIT_COMMIT").to_string(),
    })?;
    eprintln!("== demo finished in {:.1} min (after set-up and build); outputs in {}", t0.elapsed().as_secs_f64() / 60.0, w.display());
    Ok(())
}
