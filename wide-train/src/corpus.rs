//! Text corpora: documentation that Debian packages ship (the reStructuredText of
//! `linux-doc-6.1`, the HTML of `python3.11-doc` as plain text), or the user's own `.txt` /
//! `.jsonl` files and directories. A corpus is a folder with one JSONL file per split and a
//! manifest (sources, package versions, counts, hashes); the split is by document, decided by
//! a hash of the document's name, so it never changes when other documents come or go.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// One document: where it came from and its text.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Document {
    pub source: String,
    pub name: String,
    pub text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Validation,
    Test,
}

impl Split {
    pub const ALL: [Split; 3] = [Split::Train, Split::Validation, Split::Test];
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Validation => "validation",
            Split::Test => "test",
        }
    }
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "train" => Split::Train,
            "validation" | "val" | "valid" => Split::Validation,
            "test" => Split::Test,
            _ => bail!("unknown split {s:?}: use train, validation or test"),
        })
    }
}

/// Fractions of documents in validation and test (the rest trains).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SplitFractions {
    pub validation: f64,
    pub test: f64,
}

impl Default for SplitFractions {
    fn default() -> Self {
        Self { validation: 0.02, test: 0.02 }
    }
}

/// The split of a document, from a hash of its name: stable and independent of the others.
pub fn split_of(name: &str, f: SplitFractions) -> Split {
    let h = Sha256::digest(name.as_bytes());
    let u = u64::from_le_bytes(h[..8].try_into().unwrap()) as f64 / u64::MAX as f64;
    if u < f.validation {
        Split::Validation
    } else if u < f.validation + f.test {
        Split::Test
    } else {
        Split::Train
    }
}

/// Where documents come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    /// reStructuredText (plain or gzipped) under a linux-doc installation.
    LinuxDoc(PathBuf),
    /// HTML under a Python documentation installation, converted to text.
    PythonDoc(PathBuf),
    /// The user's `.txt`, `.md`, `.rst` (optionally gzipped) or `.jsonl` (`text` field) file
    /// or directory.
    User(PathBuf),
}

pub const LINUX_DOC: &str = "/usr/share/doc/linux-doc-6.1/Documentation";
pub const PYTHON_DOC: &str = "/usr/share/doc/python3.11/html";

/// The two Debian documentation sources, which `scripts/setup.sh` installs.
pub fn debian_sources() -> Vec<Source> {
    vec![Source::LinuxDoc(LINUX_DOC.into()), Source::PythonDoc(PYTHON_DOC.into())]
}

/// Sources named on a command line or in a recipe: `debian-docs` (both Debian documentation
/// packages) or paths of the user's files and folders.
pub fn sources_from_names(names: &[String]) -> Result<Vec<Source>> {
    let mut v = vec![];
    for s in names {
        if s == "debian-docs" {
            v.extend(debian_sources());
        } else {
            v.push(Source::User(PathBuf::from(s)));
        }
    }
    if v.is_empty() {
        bail!("no corpus sources given: name debian-docs or your own text files/folders");
    }
    Ok(v)
}

impl Source {
    fn label(&self) -> String {
        match self {
            Source::LinuxDoc(p) => format!("linux-doc:{}", p.display()),
            Source::PythonDoc(p) => format!("python-doc:{}", p.display()),
            Source::User(p) => format!("user:{}", p.display()),
        }
    }

    fn root(&self) -> &Path {
        match self {
            Source::LinuxDoc(p) | Source::PythonDoc(p) | Source::User(p) => p,
        }
    }

    /// Debian package that ships this source, for the manifest.
    fn package(&self) -> Option<&'static str> {
        match self {
            Source::LinuxDoc(_) => Some("linux-doc-6.1"),
            Source::PythonDoc(_) => Some("python3.11-doc"),
            Source::User(_) => None,
        }
    }

    /// Every document of this source, sorted by name.
    pub fn documents(&self) -> Result<Vec<Document>> {
        let root = self.root();
        if !root.exists() {
            match self.package() {
                Some(pkg) => bail!("{} does not exist: install the Debian package {pkg} (scripts/setup.sh does)", root.display()),
                None => bail!("input {} does not exist", root.display()),
            }
        }
        let mut files = vec![];
        walk(root, &mut files)?;
        files.sort();
        let label = self.label();
        let mut docs = vec![];
        for f in files {
            let rel = f.strip_prefix(root).unwrap_or(&f).to_string_lossy().into_owned();
            let name_of = |suffix: &str| format!("{label}/{rel}{suffix}");
            let fname = f.file_name().unwrap_or_default().to_string_lossy().into_owned();
            match self {
                Source::LinuxDoc(_) => {
                    if fname.ends_with(".rst") || fname.ends_with(".rst.gz") || fname.ends_with(".txt") || fname.ends_with(".txt.gz") {
                        let text = read_text(&f)?;
                        push_doc(&mut docs, &label, name_of(""), clean_rst(&text));
                    }
                }
                Source::PythonDoc(_) => {
                    if fname.ends_with(".html") && !rel.starts_with("_") && fname != "genindex.html" && !fname.starts_with("genindex-") {
                        let text = read_text(&f)?;
                        push_doc(&mut docs, &label, name_of(""), html_to_text(&text));
                    }
                }
                Source::User(_) => {
                    if fname.ends_with(".jsonl") {
                        let file = std::fs::File::open(&f).with_context(|| format!("cannot read {}", f.display()))?;
                        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                            let line = line.with_context(|| format!("reading {}", f.display()))?;
                            if line.trim().is_empty() {
                                continue;
                            }
                            let v: serde_json::Value = serde_json::from_str(&line)
                                .with_context(|| format!("{} line {}: not valid JSON", f.display(), i + 1))?;
                            let text = v["text"].as_str().with_context(|| {
                                format!("{} line {}: no string field \"text\"", f.display(), i + 1)
                            })?;
                            push_doc(&mut docs, &label, name_of(&format!("#{}", i + 1)), text.to_string());
                        }
                    } else if [".txt", ".md", ".rst", ".text"].iter().any(|e| fname.trim_end_matches(".gz").ends_with(e)) {
                        push_doc(&mut docs, &label, name_of(""), read_text(&f)?);
                    }
                }
            }
        }
        Ok(docs)
    }
}

fn push_doc(docs: &mut Vec<Document>, source: &str, name: String, text: String) {
    let text = normalise_whitespace(&text);
    if text.len() >= 32 {
        docs.push(Document { source: source.to_string(), name, text });
    }
}

fn walk(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let meta = std::fs::metadata(p).with_context(|| format!("cannot read {}", p.display()))?;
    if meta.is_file() {
        out.push(p.to_path_buf());
        return Ok(());
    }
    for e in std::fs::read_dir(p).with_context(|| format!("cannot list {}", p.display()))? {
        let e = e?;
        let path = e.path();
        if e.file_type()?.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// Reads a file as UTF-8 (lossily), un-gzipping `.gz`.
fn read_text(p: &Path) -> Result<String> {
    let mut bytes = vec![];
    let f = std::fs::File::open(p).with_context(|| format!("cannot read {}", p.display()))?;
    if p.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(f).read_to_end(&mut bytes).with_context(|| format!("{} is not valid gzip", p.display()))?;
    } else {
        std::io::BufReader::new(f).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", p.display()))?;
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Drops reStructuredText comment blocks and the SPDX/licence header lines; keeps the prose,
/// which is what a reader of the source sees.
fn clean_rst(s: &str) -> String {
    s.lines().filter(|l| !l.starts_with(".. SPDX") && !l.starts_with(".. _") && !l.starts_with(".. include::")).collect::<Vec<_>>().join("\n")
}

/// Collapses runs of blank lines and trailing spaces.
fn normalise_whitespace(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut blank = 0;
    for line in s.lines() {
        let line = line.trim_end();
        if line.is_empty() {
            blank += 1;
            if blank > 1 {
                continue;
            }
        } else {
            blank = 0;
        }
        out.push_str(line);
        out.push('\n');
    }
    out.trim().to_string()
}

/// HTML to readable text: the document body without scripts, styles, navigation and
/// header/footer chrome; block elements become line breaks; entities are decoded.
pub fn html_to_text(html: &str) -> String {
    // Sphinx pages keep their content in <div class="body" role="main">; fall back to <body>.
    let body = html
        .find("role=\"main\"")
        .and_then(|i| html[..i].rfind('<').map(|s| &html[s..]))
        .or_else(|| html.find("<body").map(|i| &html[i..]))
        .unwrap_or(html);
    let mut out = String::with_capacity(body.len() / 2);
    let mut skip_depth: Option<String> = None;
    let mut rest = body;
    while let Some(lt) = rest.find('<') {
        if skip_depth.is_none() {
            out.push_str(&decode_entities(&rest[..lt]));
        }
        let after = &rest[lt + 1..];
        let Some(gt) = after.find('>') else { break };
        let tag = &after[..gt];
        rest = &after[gt + 1..];
        let closing = tag.starts_with('/');
        let name: String = tag.trim_start_matches('/').chars().take_while(|c| c.is_ascii_alphanumeric()).collect::<String>().to_ascii_lowercase();
        if let Some(skip) = &skip_depth {
            if closing && &name == skip {
                skip_depth = None;
            }
            continue;
        }
        let is_footer = tag.contains("class=\"footer\"") || tag.contains("class=\"related\"") || tag.contains("class=\"sphinxsidebar\"");
        if !closing && (matches!(name.as_str(), "script" | "style" | "head" | "nav") || (name == "div" && is_footer)) {
            // Nested divs inside a skipped sidebar are rare in Sphinx output; skipping to the
            // first closing tag of the same name is good enough for prose extraction.
            skip_depth = Some(name);
            continue;
        }
        match name.as_str() {
            "p" | "div" | "br" | "li" | "tr" | "h1" | "h2" | "h3" | "h4" | "h5" | "h6" | "pre" | "dt" | "dd" | "section" | "table" | "blockquote" => {
                out.push('\n')
            }
            "td" | "th" => out.push(' '),
            _ => {}
        }
    }
    if skip_depth.is_none() {
        out.push_str(&decode_entities(rest));
    }
    // Sphinx permalink markers.
    out.replace('\u{b6}', "")
}

fn decode_entities(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        let end = after.find(';').filter(|e| *e <= 10);
        let decoded = end.and_then(|e| {
            let ent = &after[1..e];
            let c = match ent {
                "amp" => Some('&'),
                "lt" => Some('<'),
                "gt" => Some('>'),
                "quot" => Some('"'),
                "apos" | "#39" => Some('\''),
                "nbsp" => Some(' '),
                "para" => Some('\u{b6}'),
                "mdash" => Some('—'),
                "ndash" => Some('–'),
                "hellip" => Some('…'),
                "copy" => Some('©'),
                _ if ent.starts_with("#x") => u32::from_str_radix(&ent[2..], 16).ok().and_then(char::from_u32),
                _ if ent.starts_with('#') => ent[1..].parse().ok().and_then(char::from_u32),
                _ => None,
            };
            c.map(|c| (c, e))
        });
        match decoded {
            Some((c, e)) => {
                out.push(c);
                rest = &after[e + 1..];
            }
            None => {
                out.push('&');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Per-split and per-source counts in the manifest.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Counts {
    pub documents: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceEntry {
    pub source: String,
    pub package: Option<String>,
    pub package_version: Option<String>,
    pub documents: u64,
    pub bytes: u64,
}

/// What a corpus folder holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CorpusManifest {
    pub format: u32,
    pub sources: Vec<SourceEntry>,
    pub fractions: SplitFractions,
    pub splits: std::collections::BTreeMap<String, Counts>,
    /// SHA-256 of each split file, and of all of them together (the corpus identity).
    pub split_sha256: std::collections::BTreeMap<String, String>,
    pub sha256: String,
}

impl CorpusManifest {
    pub fn load(dir: &Path) -> Result<Self> {
        let p = dir.join("manifest.json");
        let text = std::fs::read_to_string(&p).with_context(|| format!("{} is not a corpus folder (no manifest.json); build one with `wide corpus`", dir.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a valid corpus manifest", p.display()))
    }
}

fn debian_version(pkg: &str) -> Option<String> {
    let out = std::process::Command::new("dpkg-query").args(["-W", "-f=${Version}", pkg]).output().ok()?;
    (out.status.success() && !out.stdout.is_empty()).then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What is at the output path of a corpus build.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CorpusTarget {
    /// Nothing, or an empty folder: the new corpus goes there.
    Free,
    /// A corpus (its manifest parses): rebuilt in place.
    Corpus,
}

/// Classifies `out` before a corpus is built there. Anything else than nothing, an empty folder
/// or a corpus is refused: a build replaces the whole folder, and a folder of the user's (or a
/// corpus whose manifest is corrupt, which may be worth inspecting) must not be deleted silently.
fn corpus_target(out: &Path) -> Result<CorpusTarget> {
    let refuse = |why: String| anyhow::anyhow!("{} already exists and {why}; remove it or choose another folder for the corpus (data.corpus_dir of the recipe, or --out of `wide corpus`)", out.display());
    let Ok(meta) = std::fs::symlink_metadata(out) else { return Ok(CorpusTarget::Free) };
    if !meta.is_dir() {
        return Err(refuse("is not a folder (a file or a link)".into()));
    }
    if std::fs::read_dir(out).with_context(|| format!("cannot read {}", out.display()))?.next().is_none() {
        return Ok(CorpusTarget::Free);
    }
    let manifest = out.join("manifest.json");
    if !manifest.exists() {
        return Err(refuse("is not a corpus folder (it has files but no manifest.json)".into()));
    }
    match CorpusManifest::load(out) {
        Ok(_) => Ok(CorpusTarget::Corpus),
        Err(e) => Err(refuse(format!("holds a corpus manifest that cannot be read ({e:#})"))),
    }
}

/// Builds a corpus folder at `out` (atomically): `train.jsonl`, `validation.jsonl`,
/// `test.jsonl` (one `{"name","source","text"}` per line) and `manifest.json`. `out` must not
/// exist, be an empty folder, or hold a corpus (which is replaced; it is moved aside, and
/// removed only once the new one is in place); anything else is an error.
pub fn build_corpus(sources: &[Source], fractions: SplitFractions, out: &Path) -> Result<CorpusManifest> {
    if sources.is_empty() {
        bail!("no corpus sources given");
    }
    corpus_target(out)?;
    let mut all = vec![];
    let mut entries = vec![];
    for s in sources {
        let docs = s.documents()?;
        entries.push(SourceEntry {
            source: s.label(),
            package: s.package().map(String::from),
            package_version: s.package().and_then(debian_version),
            documents: docs.len() as u64,
            bytes: docs.iter().map(|d| d.text.len() as u64).sum(),
        });
        all.extend(docs);
    }
    if all.is_empty() {
        bail!("the corpus is empty: no documents with text were found in {:?}", sources.iter().map(|s| s.label()).collect::<Vec<_>>());
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    let tmp = wide_core::safetensors::tmp_path(out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut splits = std::collections::BTreeMap::new();
    let mut split_sha = std::collections::BTreeMap::new();
    let mut total = Sha256::new();
    for split in Split::ALL {
        let path = tmp.join(format!("{}.jsonl", split.name()));
        let mut w = BufWriter::new(std::fs::File::create(&path)?);
        let mut h = Sha256::new();
        let mut c = Counts::default();
        for d in all.iter().filter(|d| split_of(&d.name, fractions) == split) {
            let line = serde_json::to_string(d)? + "\n";
            w.write_all(line.as_bytes())?;
            h.update(line.as_bytes());
            c.documents += 1;
            c.bytes += d.text.len() as u64;
        }
        w.flush()?;
        let digest = format!("{:x}", h.finalize());
        total.update(digest.as_bytes());
        split_sha.insert(split.name().to_string(), digest);
        splits.insert(split.name().to_string(), c);
    }
    if splits["train"].documents == 0 {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("the corpus has no training documents ({} documents in all); add more text", all.len());
    }
    let manifest = CorpusManifest {
        format: 1,
        sources: entries,
        fractions,
        splits,
        split_sha256: split_sha,
        sha256: format!("{:x}", total.finalize()),
    };
    std::fs::write(tmp.join("manifest.json"), serde_json::to_string_pretty(&manifest)?)?;
    // Checked again: the folder may have changed while the documents were read.
    let target = match corpus_target(out) {
        Ok(t) => t,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // An empty folder goes first (remove_dir refuses anything else); an earlier corpus is
    // replaced by place_folder (moved aside, removed once the new one is in place).
    if target == CorpusTarget::Free && out.exists() {
        std::fs::remove_dir(out).with_context(|| format!("replacing the empty folder {}", out.display()))?;
    }
    wide_core::checkpoint::place_folder(&tmp, out)?;
    Ok(manifest)
}

/// Reads the documents of one split of a corpus folder.
pub fn read_split(dir: &Path, split: Split) -> Result<Vec<Document>> {
    let p = dir.join(format!("{}.jsonl", split.name()));
    let f = std::fs::File::open(&p).with_context(|| format!("cannot read {} (is {} a corpus folder?)", p.display(), dir.display()))?;
    std::io::BufReader::new(f)
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let l = l?;
            serde_json::from_str(&l).with_context(|| format!("{} line {} is corrupt", p.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_body_becomes_text() {
        let html = r#"<html><head><title>x</title><style>p{}</style></head><body>
            <div class="related">nav junk</div>
            <div class="body" role="main"><h1>Title<a class="headerlink">&#182;</a></h1>
            <p>Use <code>a &amp; b</code> &lt;here&gt;.</p><script>var x;</script><p>Second&nbsp;para.</p></div>
            <div class="footer">copyright</div></body></html>"#;
        let t = normalise_whitespace(&html_to_text(html));
        assert!(t.contains("Title"), "{t}");
        assert!(t.contains("Use a & b <here>."), "{t}");
        assert!(t.contains("Second para."), "{t}");
        assert!(!t.contains("nav junk") && !t.contains("var x") && !t.contains("copyright") && !t.contains('¶'), "{t}");
    }

    #[test]
    fn split_is_stable_and_roughly_proportional() {
        let f = SplitFractions { validation: 0.1, test: 0.1 };
        let names: Vec<String> = (0..5000).map(|i| format!("doc-{i}")).collect();
        let val = names.iter().filter(|n| split_of(n, f) == Split::Validation).count();
        let test = names.iter().filter(|n| split_of(n, f) == Split::Test).count();
        assert!((400..600).contains(&val) && (400..600).contains(&test), "{val} {test}");
        assert_eq!(split_of("doc-17", f), split_of("doc-17", f));
    }

    #[test]
    fn user_text_and_jsonl_with_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "Some plain text that is long enough to count as a document.").unwrap();
        std::fs::write(dir.path().join("b.jsonl"), "{\"text\": \"A JSON lines document with enough characters in it.\"}\n\n").unwrap();
        let docs = Source::User(dir.path().into()).documents().unwrap();
        assert_eq!(docs.len(), 2);
        std::fs::write(dir.path().join("c.jsonl"), "{\"body\": 1}\n").unwrap();
        let e = Source::User(dir.path().into()).documents().unwrap_err();
        assert!(format!("{e:#}").contains("c.jsonl line 1: no string field \"text\""), "{e:#}");
    }

    /// Builds from one user folder of a few documents into `out`.
    fn build_into(out: &Path) -> Result<CorpusManifest> {
        let src = tempfile::tempdir().unwrap();
        for i in 0..5 {
            std::fs::write(src.path().join(format!("d{i}.txt")), format!("Document number {i} has enough plain text to count as a document.")).unwrap();
        }
        build_corpus(&[Source::User(src.path().into())], SplitFractions { validation: 0.0, test: 0.0 }, out)
    }

    #[test]
    fn a_folder_that_is_not_a_corpus_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        // The user's own folder.
        let user = dir.path().join("mine");
        std::fs::create_dir(&user).unwrap();
        std::fs::write(user.join("notes.txt"), "keep me").unwrap();
        let e = format!("{:#}", build_into(&user).unwrap_err());
        assert!(e.contains(&format!("{} already exists and is not a corpus folder", user.display())) && e.contains("remove it or choose another folder"), "{e}");
        assert_eq!(std::fs::read_to_string(user.join("notes.txt")).unwrap(), "keep me");
        // A corpus whose manifest is truncated: refused, left as it is.
        let corrupt = dir.path().join("corpus");
        build_into(&corrupt).unwrap();
        let text = std::fs::read_to_string(corrupt.join("manifest.json")).unwrap();
        std::fs::write(corrupt.join("manifest.json"), &text[..text.len() / 2]).unwrap();
        let e = format!("{:#}", build_into(&corrupt).unwrap_err());
        assert!(e.contains("holds a corpus manifest that cannot be read") && e.contains("remove it or choose another folder"), "{e}");
        assert!(corrupt.join("train.jsonl").exists());
        // A file is not a folder.
        std::fs::write(dir.path().join("file"), "x").unwrap();
        assert!(format!("{:#}", build_into(&dir.path().join("file")).unwrap_err()).contains("is not a folder"));
        // No temporary or set-aside folders are left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    }

    #[test]
    fn an_empty_folder_or_a_corpus_is_built_into() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let m = build_into(&empty).unwrap();
        assert_eq!(m.splits["train"].documents, 5);
        assert_eq!(CorpusManifest::load(&empty).unwrap().sha256, m.sha256);
        // Rebuilding a corpus replaces it.
        std::fs::write(empty.join("train.jsonl"), "").unwrap();
        build_into(&empty).unwrap();
        assert_eq!(read_split(&empty, Split::Train).unwrap().len(), 5);
        let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["empty".to_string()]);
    }

    #[test]
    fn empty_corpus_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "short").unwrap();
        let e = build_corpus(&[Source::User(dir.path().into())], SplitFractions::default(), &dir.path().join("out")).unwrap_err();
        assert!(format!("{e:#}").contains("the corpus is empty"), "{e:#}");
        assert!(!dir.path().join("out").exists());
    }
}
