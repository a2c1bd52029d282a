//! Packed token datasets: a corpus split tokenized in parallel, documents joined with EOS, and
//! stored as one little-endian id stream behind a small header, memory-mapped for reading.
//! Sample `i` of length `L` is tokens `[i*L, i*L + L + 1)` (inputs and shifted targets).
//! Files are cached under a key of corpus hash, tokenizer hash and sequence length.
use crate::corpus::{read_split, CorpusManifest, Split};
use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::Tensor;
use wide_core::Tokenizer;

const MAGIC: &[u8; 8] = b"WIDETOK1";
const HEADER: usize = 64;

/// Width of a stored token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdDtype {
    U16,
    U32,
}

impl IdDtype {
    pub fn bytes(self) -> usize {
        match self {
            IdDtype::U16 => 2,
            IdDtype::U32 => 4,
        }
    }
    /// The narrowest type that holds `vocab_size` ids.
    pub fn for_vocab(vocab_size: u64) -> Self {
        if vocab_size <= 1 << 16 {
            IdDtype::U16
        } else {
            IdDtype::U32
        }
    }
    pub fn check_fits(self, vocab_size: u64) -> Result<()> {
        if self == IdDtype::U16 && vocab_size > 1 << 16 {
            bail!("a vocabulary of {vocab_size} ids does not fit u16 token storage (at most 65536); use u32");
        }
        Ok(())
    }
}

/// A memory-mapped token file.
pub struct TokenFile {
    pub path: PathBuf,
    map: memmap2::Mmap,
    pub dtype: IdDtype,
    pub vocab_size: u64,
    pub count: u64,
    pub eos_id: u64,
    pub documents: u64,
}

/// Writes `ids` (already EOS-separated) with a header, atomically.
pub fn write_tokens(path: &Path, ids: &[u32], dtype: IdDtype, vocab_size: u64, eos_id: u64, documents: u64) -> Result<()> {
    dtype.check_fits(vocab_size)?;
    let tmp = wide_core::safetensors::tmp_path(path);
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[12..16].copy_from_slice(&(dtype.bytes() as u32).to_le_bytes());
    h[16..24].copy_from_slice(&vocab_size.to_le_bytes());
    h[24..32].copy_from_slice(&(ids.len() as u64).to_le_bytes());
    h[32..40].copy_from_slice(&eos_id.to_le_bytes());
    h[40..48].copy_from_slice(&documents.to_le_bytes());
    w.write_all(&h)?;
    for &id in ids {
        if id as u64 >= vocab_size {
            bail!("token id {id} is outside the vocabulary of {vocab_size}");
        }
        match dtype {
            IdDtype::U16 => w.write_all(&(id as u16).to_le_bytes())?,
            IdDtype::U32 => w.write_all(&id.to_le_bytes())?,
        }
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

impl TokenFile {
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).with_context(|| format!("cannot open token file {}", path.display()))?;
        // SAFETY: the file is only read; files are replaced by rename, never rewritten in place.
        let map = unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))?;
        let bad = |why: &str| anyhow::anyhow!("{} is not a valid token file ({why}); delete it to rebuild", path.display());
        if map.len() < HEADER || &map[..8] != MAGIC {
            return Err(bad("bad header"));
        }
        let u64_at = |o: usize| u64::from_le_bytes(map[o..o + 8].try_into().unwrap());
        let width = u32::from_le_bytes(map[12..16].try_into().unwrap());
        let dtype = match width {
            2 => IdDtype::U16,
            4 => IdDtype::U32,
            _ => return Err(bad("unknown id width")),
        };
        let (vocab_size, count, eos_id, documents) = (u64_at(16), u64_at(24), u64_at(32), u64_at(40));
        if (map.len() - HEADER) as u64 != count * dtype.bytes() as u64 {
            return Err(bad("size does not match the token count: truncated?"));
        }
        Ok(Self { path: path.to_path_buf(), map, dtype, vocab_size, count, eos_id, documents })
    }

    /// Tokens `[start, start + len)` as i64.
    pub fn slice(&self, start: u64, len: usize) -> Vec<i64> {
        let w = self.dtype.bytes();
        let b = HEADER + start as usize * w;
        let bytes = &self.map[b..b + len * w];
        match self.dtype {
            IdDtype::U16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as i64).collect(),
            IdDtype::U32 => bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        }
    }

    /// Number of samples of length `seq_len` (each needs `seq_len + 1` tokens).
    pub fn num_sequences(&self, seq_len: usize) -> u64 {
        if self.count <= seq_len as u64 {
            0
        } else {
            (self.count - 1) / seq_len as u64
        }
    }

    /// `[n, seq_len + 1]` i64 tensor of the given samples.
    pub fn batch(&self, indices: &[u64], seq_len: usize) -> Tensor {
        let mut v = Vec::with_capacity(indices.len() * (seq_len + 1));
        for &i in indices {
            v.extend(self.slice(i * seq_len as u64, seq_len + 1));
        }
        Tensor::from_slice(&v).view([indices.len() as i64, seq_len as i64 + 1])
    }

    /// Every token as i64 (for small splits and statistics).
    pub fn all(&self) -> Vec<i64> {
        self.slice(0, self.count as usize)
    }
}

/// The order in which training samples are visited: a fresh seeded permutation per epoch, so a
/// global position (samples consumed so far) fully determines what comes next, whatever the
/// number of processes.
pub struct SampleOrder {
    n: u64,
    seed: u64,
    epoch: Option<u64>,
    perm: Vec<u64>,
}

impl SampleOrder {
    pub fn new(n: u64, seed: u64) -> Self {
        Self { n, seed, epoch: None, perm: vec![] }
    }
    /// Sample index at global position `pos`.
    pub fn at(&mut self, pos: u64) -> u64 {
        let epoch = pos / self.n;
        if self.epoch != Some(epoch) {
            let mut p: Vec<u64> = (0..self.n).collect();
            p.shuffle(&mut StdRng::seed_from_u64(self.seed.wrapping_mul(1_000_003).wrapping_add(epoch)));
            self.perm = p;
            self.epoch = Some(epoch);
        }
        self.perm[(pos % self.n) as usize]
    }
}

pub fn sha256_file(p: &Path) -> Result<String> {
    let bytes = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

/// Token files of one corpus, tokenizer and sequence length.
pub struct DatasetFiles {
    pub dir: PathBuf,
    pub seq_len: usize,
}

impl DatasetFiles {
    pub fn path(&self, split: Split) -> PathBuf {
        self.dir.join(format!("{}.tokens", split.name()))
    }
    pub fn open(&self, split: Split) -> Result<TokenFile> {
        TokenFile::open(&self.path(split))
    }
}

/// Tokenizes every split of `corpus_dir` with `tokenizer` (cached in `cache_root` under the
/// key corpus hash + tokenizer hash + `seq_len`). Returns the dataset folder.
pub fn build_dataset(corpus_dir: &Path, tokenizer_path: &Path, seq_len: usize, cache_root: &Path) -> Result<DatasetFiles> {
    ensure!(seq_len >= 2, "sequence length must be at least 2, got {seq_len}");
    let manifest = CorpusManifest::load(corpus_dir)?;
    let tok_hash = sha256_file(tokenizer_path)?;
    let key = format!("{}-{}-L{seq_len}", &manifest.sha256[..12], &tok_hash[..12]);
    let dir = cache_root.join(key);
    let files = DatasetFiles { dir: dir.clone(), seq_len };
    if Split::ALL.iter().all(|s| files.open(*s).is_ok()) {
        return Ok(files);
    }
    let tok = Tokenizer::from_file(tokenizer_path)?;
    let vocab = tok.vocab_size() as u64;
    let eos = tok.token_id(crate::bpe::EOS_TOKEN).with_context(|| format!("tokenizer {} has no {} token", tokenizer_path.display(), crate::bpe::EOS_TOKEN))? as u32;
    let dtype = IdDtype::for_vocab(vocab);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for split in Split::ALL {
        let docs = read_split(corpus_dir, split)?;
        let pb = crate::progress::bar(docs.len() as u64, &format!("tokenizing {}", split.name()));
        let encoded: Vec<Vec<u32>> = docs
            .par_iter()
            .map(|d| {
                let ids = tok.inner().encode(d.text.as_str(), false).map(|e| e.get_ids().to_vec());
                pb.inc(1);
                ids
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))?;
        pb.finish_and_clear();
        let mut ids = Vec::with_capacity(encoded.iter().map(|e| e.len() + 1).sum());
        for e in &encoded {
            ids.extend_from_slice(e);
            ids.push(eos);
        }
        write_tokens(&files.path(split), &ids, dtype, vocab, eos as u64, docs.len() as u64)?;
        eprintln!("{}: {} documents, {} tokens", split.name(), docs.len(), ids.len());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_roundtrip_and_batches() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.tokens");
        let ids: Vec<u32> = (0..1001).map(|i| i % 300).collect();
        write_tokens(&p, &ids, IdDtype::U16, 300, 0, 3).unwrap();
        let f = TokenFile::open(&p).unwrap();
        assert_eq!((f.count, f.vocab_size, f.documents), (1001, 300, 3));
        assert_eq!(f.num_sequences(100), 10);
        let b = f.batch(&[0, 3], 100);
        assert_eq!(b.size(), vec![2, 101]);
        assert_eq!(b.int64_value(&[1, 0]), 300 % 300);
        assert_eq!(b.int64_value(&[1, 100]), 400 % 300);
        // Truncation is detected.
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        assert!(format!("{:#}", TokenFile::open(&p).err().unwrap()).contains("truncated"));
    }

    #[test]
    fn vocabulary_must_fit_the_id_type() {
        let dir = tempfile::tempdir().unwrap();
        let e = write_tokens(&dir.path().join("y.tokens"), &[1, 2], IdDtype::U16, 70000, 0, 1).unwrap_err();
        assert!(format!("{e:#}").contains("does not fit u16"), "{e:#}");
        assert_eq!(IdDtype::for_vocab(70000), IdDtype::U32);
    }

    #[test]
    fn sample_order_is_a_permutation_per_epoch_and_seeded() {
        let mut a = SampleOrder::new(50, 7);
        let mut b = SampleOrder::new(50, 7);
        let e0: Vec<u64> = (0..50).map(|p| a.at(p)).collect();
        let mut sorted = e0.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        let e1: Vec<u64> = (50..100).map(|p| a.at(p)).collect();
        assert_ne!(e0, e1);
        // Random access from any position gives the same stream.
        assert_eq!(b.at(73), e1[23]);
        assert_eq!(b.at(5), e0[5]);
    }
}
