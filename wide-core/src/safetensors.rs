//! Safetensors files, read tensor by tensor and written atomically.
//!
//! Reading parses the JSON header and then reads each tensor's bytes straight into the memory
//! of a tch tensor with positioned reads, so loading a checkpoint needs about its own size in
//! host memory, never a second copy of a whole file. Writing streams tensors into a temporary
//! file that is renamed into place once complete.
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Where one tensor lives in a safetensors file.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub kind: Kind,
    pub dtype: String,
    pub shape: Vec<i64>,
    /// Absolute byte range in the file.
    pub start: u64,
    pub end: u64,
}

/// An open safetensors file: its header and a handle for positioned reads.
pub struct SafetensorsFile {
    pub path: PathBuf,
    file: File,
    pub tensors: BTreeMap<String, TensorEntry>,
    pub metadata: BTreeMap<String, String>,
}

pub fn kind_of_dtype(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "F64" => Kind::Double,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

pub fn dtype_of_kind(kind: Kind) -> Result<&'static str> {
    Ok(match kind {
        Kind::Float => "F32",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Double => "F64",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        k => bail!("cannot store tensors of kind {k:?} in safetensors"),
    })
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let size = file.metadata()?.len();
        let bad = |why: String| {
            anyhow::anyhow!(
                "{} is not a valid safetensors file ({why}); it may be truncated or corrupt: re-download or re-export it",
                path.display()
            )
        };
        if size < 8 {
            return Err(bad(format!("{size} bytes is too short for a header")));
        }
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)?;
        let header_len = u64::from_le_bytes(n);
        if header_len > 100 << 20 || 8 + header_len > size {
            return Err(bad(format!("header length {header_len} does not fit the file of {size} bytes")));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8)?;
        let header: Value = serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let obj = header.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                if let Some(m) = v.as_object() {
                    for (k, v) in m {
                        metadata.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                    }
                }
                continue;
            }
            let dtype = v["dtype"].as_str().ok_or_else(|| bad(format!("tensor {name} has no dtype")))?;
            let kind = kind_of_dtype(dtype).ok_or_else(|| bad(format!("tensor {name} has unsupported dtype {dtype}")))?;
            let shape: Vec<i64> = v["shape"]
                .as_array()
                .ok_or_else(|| bad(format!("tensor {name} has no shape")))?
                .iter()
                .map(|d| d.as_i64().unwrap_or(-1))
                .collect();
            let offs = v["data_offsets"].as_array().ok_or_else(|| bad(format!("tensor {name} has no data_offsets")))?;
            let (b, e) = match offs.as_slice() {
                [b, e] => (b.as_u64().unwrap_or(u64::MAX), e.as_u64().unwrap_or(0)),
                _ => return Err(bad(format!("tensor {name} has malformed data_offsets"))),
            };
            let numel: i64 = shape.iter().product();
            if shape.iter().any(|d| *d < 0) || e < b || (e - b) != numel as u64 * kind.elt_size_in_bytes() as u64 {
                return Err(bad(format!("tensor {name}: shape {shape:?} {dtype} does not match its {} bytes", e.wrapping_sub(b))));
            }
            if data_start + e > size {
                return Err(bad(format!(
                    "tensor {name} ends at byte {} but the file has {size} bytes",
                    data_start + e
                )));
            }
            tensors.insert(
                name.clone(),
                TensorEntry { kind, dtype: dtype.to_string(), shape, start: data_start + b, end: data_start + e },
            );
        }
        Ok(Self { path: path.to_path_buf(), file, tensors, metadata })
    }

    /// Reads one tensor into a new CPU tensor of the file's dtype.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let e = self
            .tensors
            .get(name)
            .with_context(|| format!("tensor {name} is not in {}", self.path.display()))?;
        let t = Tensor::empty(e.shape.as_slice(), (e.kind, tch::Device::Cpu));
        let len = (e.end - e.start) as usize;
        if len > 0 {
            // SAFETY: `t` is a fresh contiguous CPU tensor of exactly `len` bytes.
            let buf = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, len) };
            self.file
                .read_exact_at(buf, e.start)
                .with_context(|| format!("reading tensor {name} from {}", self.path.display()))?;
        }
        Ok(t)
    }
}

/// Writes tensors to `path` in safetensors format: into `path.tmp` first, renamed when complete.
/// Tensors are written in the order given; each is moved to the CPU one at a time.
pub fn write(path: &Path, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        let bytes = t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_of_kind(t.kind())?, "shape": t.size(), "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let tmp = tmp_path(path);
    let result = (|| -> Result<()> {
        let f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        for (name, t) in tensors {
            let t = t.to_device(tch::Device::Cpu).contiguous();
            let len = t.numel() * t.kind().elt_size_in_bytes();
            if len > 0 {
                // SAFETY: contiguous CPU tensor of `len` bytes, alive for the borrow.
                let buf = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) };
                w.write_all(buf).with_context(|| format!("writing tensor {name}"))?;
            }
        }
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        Ok(())
    })();
    match result {
        Ok(()) => std::fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display())),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e.context(format!("writing {}", path.display())))
        }
    }
}

/// `dir/name` -> `dir/.name.tmp-PID`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read_roundtrips_every_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        let a = Tensor::randn([3, 5], (Kind::Float, tch::Device::Cpu));
        let b = a.to_kind(Kind::BFloat16);
        let c = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu));
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write(&p, &[("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone()), ("c".into(), c.shallow_clone())], &meta).unwrap();
        let f = SafetensorsFile::open(&p).unwrap();
        assert_eq!(f.metadata.get("format").map(String::as_str), Some("pt"));
        assert!(f.read("a").unwrap().equal(&a));
        assert!(f.read("b").unwrap().equal(&b));
        assert!(f.read("c").unwrap().equal(&c));
        assert!(format!("{:#}", f.read("zz").unwrap_err()).contains("tensor zz is not in"));
    }

    #[test]
    fn truncated_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        write(&p, &[("w".into(), Tensor::ones([64, 64], (Kind::Float, tch::Device::Cpu)))], &BTreeMap::new()).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
        let msg = format!("{:#}", SafetensorsFile::open(&p).err().unwrap());
        assert!(msg.contains("truncated") && msg.contains("tensor w ends at byte"), "{msg}");
        std::fs::write(&p, &bytes[..4]).unwrap();
        assert!(format!("{:#}", SafetensorsFile::open(&p).err().unwrap()).contains("too short"));
    }
}
