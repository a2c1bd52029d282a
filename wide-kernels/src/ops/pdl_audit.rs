//! Machine-code audit of the programmatic-dependent-launch kernels (CPU, no GPU).
//!
//! A kernel launched with `launch_pdl` may start while the launch before it still runs, so
//! nothing that launch writes may be read before the kernel's `griddepcontrol.wait` (pdl.cuh).
//! The source orders its loads only in PTX; ptxas schedules them again, and a load it may treat
//! as read-only for the kernel's lifetime (`ld.global.nc`: through `const T* __restrict__` or
//! `__ldg`) can move above the wait (`ACQBULK` in sm_90 machine code). That happened once
//! (NOTES v34): the routed GEMM read a count the layout launch had not yet written.
//!
//! The check, for every entry of a shipped variant whose PTX waits: the machine code has no more
//! read-only global loads that can run before a wait (on some path from the entry that passes no
//! unconditional wait, branches and loops followed) than the PTX has. Loads placed before the
//! wait on purpose (weights, data older than the launch before) are in both counts; one the
//! assembler hoisted is not. Nor, wait by wait, more read-only loads that can run before that
//! wait with no other wait between (a wait on one branch only: a load after it is already ahead
//! of any wait on the other branch, so only this count shows it moved). Predicates are not
//! evaluated: a read-only load predicated on the branch that skips a wait, scheduled above that
//! wait, looks hoisted; read such data with coherent loads. Coherent loads are counted for the
//! message only: ptxas keeps them on
//! their side of the wait, and it unrolls loops the PTX keeps rolled (a 32-step mask loop is one
//! load in PTX and 32 in machine code), so their counts differ without any hazard.
//! The machine code is read with `cuobjdump -sass`, which ships with the virtual environment's
//! Triton (a PyTorch dependency on Linux x86-64); `WIDE_CUOBJDUMP` names another one.
use std::collections::HashMap;
use std::path::PathBuf;

/// Global loads of one entry that can run before its wait.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Ahead {
    /// Read-only loads (`ld.global.nc` in PTX, `LDG.*.CONSTANT` in machine code) that some path
    /// from the entry reaches before any wait.
    read_only: usize,
    /// Every global load that some path reaches before any wait.
    all: usize,
    /// For each wait, the read-only loads that can run before it with no wait in between
    /// (ascending): a load moved from behind a wait to ahead of it raises one of these even
    /// where another path already reached it before a wait (a wait on one branch only).
    per_wait: Vec<usize>,
}

/// One instruction of a control-flow graph: what it is, and where control goes after it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Inst {
    /// A global load (read-only or not).
    Load { read_only: bool },
    /// An unpredicated wait: the paths this audit follows end there.
    Wait,
    /// Anything else; `jump` names a branch target, `falls` whether control can reach the next instruction.
    Other { jump: Option<String>, falls: bool },
}

/// The loads that can run before a wait, and whether the code waits at all. `labels` maps each
/// branch target to the index of the instruction it names (the length of `code` for a label at
/// the end).
fn ahead_of_wait(code: &[Inst], labels: &HashMap<String, usize>) -> (Ahead, bool) {
    let n = code.len();
    let succ: Vec<Vec<usize>> = code
        .iter()
        .enumerate()
        .map(|(i, inst)| {
            let mut s = Vec::new();
            match inst {
                Inst::Wait | Inst::Load { .. } => s.push(i + 1),
                Inst::Other { jump, falls } => {
                    if let Some(t) = jump {
                        s.push(*labels.get(t.as_str()).unwrap_or_else(|| panic!("branch to {t}, which is not an instruction of the function")));
                    }
                    if *falls {
                        s.push(i + 1);
                    }
                }
            }
            s.retain(|&j| j < n);
            s
        })
        .collect();
    let mut pred = vec![Vec::new(); n];
    for (i, s) in succ.iter().enumerate() {
        for &j in s {
            pred[j].push(i);
        }
    }
    // Forward from the entry, not past a wait.
    let mut ahead = vec![false; n];
    let mut todo = vec![0usize];
    while let Some(i) = todo.pop() {
        if i >= n || ahead[i] {
            continue;
        }
        ahead[i] = true;
        if code[i] != Inst::Wait {
            todo.extend(&succ[i]);
        }
    }
    let ro = |i: usize| matches!(code[i], Inst::Load { read_only: true });
    let mut a = Ahead::default();
    for i in (0..n).filter(|&i| ahead[i]) {
        if let Inst::Load { read_only } = code[i] {
            a.all += 1;
            a.read_only += read_only as usize;
        }
    }
    // Backward from each wait, not past another.
    let mut waits = 0;
    for w in (0..n).filter(|&i| code[i] == Inst::Wait) {
        waits += 1;
        let mut back = vec![false; n];
        let mut todo = pred[w].clone();
        while let Some(i) = todo.pop() {
            if back[i] || code[i] == Inst::Wait {
                continue;
            }
            back[i] = true;
            todo.extend(&pred[i]);
        }
        a.per_wait.push((0..n).filter(|&i| back[i] && ahead[i] && ro(i)).count());
    }
    a.per_wait.sort_unstable();
    (a, waits > 0)
}

/// PTX entries that contain `griddepcontrol.wait`, with the loads that can run before it.
fn ptx_entries(ptx: &str) -> HashMap<String, Ahead> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        let after = &rest[at + ".entry ".len()..];
        let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let body_end = after.find(".entry ").unwrap_or(after.len());
        let body = &after[after.find('{').unwrap_or(body_end).min(body_end)..body_end];
        rest = &after[body_end..];
        let mut code: Vec<Inst> = Vec::new();
        let mut labels = HashMap::new();
        for line in body.lines() {
            let line = line.split("//").next().unwrap_or("").trim();
            if line.is_empty() || line == "{" || line == "}" || line.starts_with('.') {
                continue;
            }
            if let Some(l) = line.strip_suffix(':') {
                labels.insert(l.to_string(), code.len());
                continue;
            }
            // `@%p1 bra $L__BB0_4;`: the predicate is the first word.
            let (pred, inst) = match line.strip_prefix('@') {
                Some(p) => (true, p.split_once(char::is_whitespace).map_or("", |(_, r)| r.trim_start())),
                None => (false, line),
            };
            let op = inst.split(|c: char| c.is_whitespace() || c == ';').next().unwrap_or("");
            let i = if op.starts_with("ld.global.") || op.starts_with("ldu.global.") {
                Inst::Load { read_only: op.starts_with("ld.global.nc") }
            } else if op == "griddepcontrol.wait" && !pred {
                Inst::Wait
            } else if op == "bra" || op.starts_with("bra.") {
                let t = inst.trim_end_matches(';').split_whitespace().last().unwrap_or("").to_string();
                Inst::Other { jump: Some(t), falls: pred }
            } else if op == "ret" || op == "exit" || op == "trap" {
                Inst::Other { jump: None, falls: pred }
            } else {
                assert!(!op.starts_with("brx"), "{name}: indirect branch ({line}): the audit cannot follow it");
                Inst::Other { jump: None, falls: true }
            };
            code.push(i);
        }
        let (a, waits) = ahead_of_wait(&code, &labels);
        if waits || body.contains("griddepcontrol.wait") {
            out.insert(name, a);
        }
    }
    out
}

/// `cuobjdump -sass` functions: the loads that can run before an `ACQBULK`, or None without one.
fn sass_functions(sass: &str) -> HashMap<String, Option<Ahead>> {
    let mut funcs: Vec<(String, Vec<Inst>, HashMap<String, usize>)> = Vec::new();
    for line in sass.lines() {
        if let Some(at) = line.find("Function : ") {
            funcs.push((line[at + "Function : ".len()..].trim().to_string(), Vec::new(), HashMap::new()));
            continue;
        }
        let Some((_, code, labels)) = funcs.last_mut() else { continue };
        // `/*0910*/   @!P2 LDG.E R9, desc[UR18][R2.64] ;   /* 0x... */`
        let Some((addr, inst)) = line.trim_start().strip_prefix("/*").and_then(|l| l.split_once("*/")) else { continue };
        let Ok(addr) = u64::from_str_radix(addr.trim(), 16) else { continue };
        let inst = inst.split("/*").next().unwrap_or("").trim().trim_end_matches(';').trim();
        let mut words = inst.split_whitespace().peekable();
        let pred = words.peek().is_some_and(|w| w.starts_with('@'));
        if pred {
            words.next();
        }
        let op = words.next().unwrap_or("");
        let args: Vec<&str> = words.map(|w| w.trim_end_matches(',')).collect();
        let i = if op == "LDG" || op.starts_with("LDG.") {
            Inst::Load { read_only: op.contains(".CONSTANT") }
        } else if op == "ACQBULK" && !pred {
            Inst::Wait
        } else if op == "BRA" || op.starts_with("BRA.") {
            // `BRA.U !UP0, 0x1230`: a predicate operand makes it conditional too.
            let cond = pred || args.iter().any(|a| a.trim_start_matches('!').starts_with('P') || a.trim_start_matches('!').starts_with("UP"));
            let t = args.iter().rev().find_map(|a| a.strip_prefix("0x")).map(|h| u64::from_str_radix(h, 16).expect("a hexadecimal branch target"));
            let t = t.unwrap_or_else(|| panic!("branch without a target address: {inst}"));
            Inst::Other { jump: Some(format!("{t:x}")), falls: cond }
        } else if op == "EXIT" || op == "RET" || op.starts_with("RET.") {
            Inst::Other { jump: None, falls: pred }
        } else {
            assert!(!op.starts_with("BRX") && !op.starts_with("JMX"), "indirect branch ({inst}): the audit cannot follow it");
            Inst::Other { jump: None, falls: true }
        };
        labels.insert(format!("{addr:x}"), code.len());
        code.push(i);
    }
    funcs
        .into_iter()
        .map(|(name, code, labels)| {
            let (a, waits) = ahead_of_wait(&code, &labels);
            (name, waits.then_some(a))
        })
        .collect()
}

/// Entries whose machine code has more read-only loads ahead of a wait than their PTX.
fn hoisted(ptx: &HashMap<String, Ahead>, sass: &HashMap<String, Option<Ahead>>) -> Vec<String> {
    let mut bad = Vec::new();
    let mut names: Vec<_> = ptx.keys().collect();
    names.sort();
    for name in names {
        let p = &ptx[name];
        match sass.get(name) {
            None => bad.push(format!("{name}: in the PTX but not in the machine code")),
            Some(None) => bad.push(format!("{name}: the PTX waits (griddepcontrol.wait) but the machine code has no ACQBULK")),
            Some(Some(s)) => {
                // The waits matched in order of their counts; with a different number of them
                // (the assembler duplicated or merged one), their totals.
                let per_wait = if s.per_wait.len() == p.per_wait.len() {
                    s.per_wait.iter().zip(&p.per_wait).any(|(a, b)| a > b)
                } else {
                    s.per_wait.iter().sum::<usize>() > p.per_wait.iter().sum::<usize>()
                };
                if s.read_only > p.read_only || per_wait {
                    bad.push(format!(
                        "{name}: {} read-only global loads can run before ACQBULK in the machine code against {} before \
                         griddepcontrol.wait in the PTX; before each wait {:?} against {:?} (all global loads: {} against {})",
                        s.read_only, p.read_only, s.per_wait, p.per_wait, s.all, p.all
                    ));
                }
            }
        }
    }
    bad
}

fn cuobjdump() -> PathBuf {
    if let Some(p) = std::env::var_os("WIDE_CUOBJDUMP") {
        return PathBuf::from(p);
    }
    let venv = std::env::var_os("WIDE_VENV").map(PathBuf::from);
    let found = venv.as_ref().and_then(|v| {
        let lib = std::fs::read_dir(v.join("lib")).ok()?;
        lib.flatten()
            .map(|py| py.path().join("site-packages/triton/backends/nvidia/bin/cuobjdump"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "cuobjdump not found: it comes with the virtual environment's Triton (set WIDE_VENV with `eval \"$(bash scripts/setup.sh \
             --print-env)\"`), or name one with WIDE_CUOBJDUMP"
        )
    })
}

#[test]
fn the_audit_follows_branches_to_the_loads_ahead_of_a_wait() {
    // The second read-only load is reached before any wait when the branch skips the first wait;
    // the last load only after an unconditional one.
    let ptx = "\
.visible .entry k(\n  .param .u64 k_param_0\n)\n{\n  .reg .b32 %r<4>;\n  ld.global.nc.u32 %r1, [%rd1];\n  @%p1 bra $L__BB0_2;\n\
  griddepcontrol.wait;\n$L__BB0_2:\n  ld.global.nc.u32 %r2, [%rd2]; // comment\n  griddepcontrol.wait;\n  ld.global.u32 %r3, [%rd3];\n  ret;\n}\n\
.visible .entry plain(\n)\n{\n  ld.global.u32 %r1, [%rd1];\n  ret;\n}\n";
    let p = ptx_entries(ptx);
    assert_eq!(p.keys().collect::<Vec<_>>(), vec!["k"], "only entries that wait");
    // The first wait follows the first load; the second both (one through the branch).
    assert_eq!(p["k"], Ahead { read_only: 2, all: 2, per_wait: vec![1, 2] });
    let sass = |lines: &[&str]| {
        let mut s = String::from("\t\tFunction : k\n");
        for (i, l) in lines.iter().enumerate() {
            s += &format!("        /*{:04x}*/                   {l} ;   /* 0x000000000000782e */\n", 16 * i);
        }
        s
    };
    let same = ["LDG.E.CONSTANT R1, desc[UR4][R2.64]", "@P0 BRA 0x30", "ACQBULK", "LDG.E.CONSTANT R2, desc[UR4][R4.64]", "ACQBULK", "LDG.E R3, desc[UR4][R6.64]", "EXIT"];
    assert!(hoisted(&p, &sass_functions(&sass(&same))).is_empty());
    // The last load moved above the second wait: on the branch's path it now runs before any.
    let moved = ["LDG.E.CONSTANT R1, desc[UR4][R2.64]", "@P0 BRA 0x30", "ACQBULK", "LDG.E.CONSTANT R2, desc[UR4][R4.64]", "LDG.E.CONSTANT R3, desc[UR4][R6.64]", "ACQBULK", "EXIT"];
    let bad = hoisted(&p, &sass_functions(&sass(&moved)));
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with("k: 3 read-only global loads"), "{}", bad[0]);
    // A branch over the second wait reaches the load behind it; coherent loads are not compared.
    let skipped = ["LDG.E.CONSTANT R1, desc[UR4][R2.64]", "@P0 BRA 0x30", "ACQBULK", "LDG.E.CONSTANT R2, desc[UR4][R4.64]", "@P1 BRA 0x60", "ACQBULK", "LDG.E.CONSTANT R3, desc[UR4][R6.64]", "@P2 BRA.U 0x50", "EXIT"];
    assert_eq!(hoisted(&p, &sass_functions(&sass(&skipped))).len(), 1, "the branch to 0x60 skips the second wait");
    let coherent = ["LDG.E.CONSTANT R1, desc[UR4][R2.64]", "@P0 BRA 0x30", "ACQBULK", "LDG.E.CONSTANT R2, desc[UR4][R4.64]", "LDG.E R3, desc[UR4][R6.64]", "LDG.E R4, desc[UR4][R6.64]", "ACQBULK", "EXIT"];
    assert!(hoisted(&p, &sass_functions(&sass(&coherent))).is_empty());
    // A wait on one branch only, with the load after it: the other branch reaches the load
    // before any wait, so only the count before each wait shows the load moved above it.
    let ptx = ".visible .entry k(\n)\n{\n  @%p1 bra $L__BB0_2;\n  griddepcontrol.wait;\n$L__BB0_2:\n  ld.global.nc.u32 %r2, [%rd2];\n  ret;\n}\n";
    let one = ptx_entries(ptx);
    assert_eq!(one["k"], Ahead { read_only: 1, all: 1, per_wait: vec![0] });
    assert!(hoisted(&one, &sass_functions(&sass(&["@P0 BRA 0x20", "ACQBULK", "LDG.E.CONSTANT R2, desc[UR4][R4.64]", "EXIT"]))).is_empty());
    let bad = hoisted(&one, &sass_functions(&sass(&["LDG.E.CONSTANT R2, desc[UR4][R4.64]", "@P0 BRA 0x30", "ACQBULK", "EXIT"])));
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("before each wait [1] against [0]"), "{}", bad[0]);
    assert!(!hoisted(&p, &sass_functions(&sass(&["LDG.E R1, desc[UR4][R2.64]", "EXIT"]))).is_empty(), "no ACQBULK");
}

/// The audit of one compiled variant: `ptx` its PTX, `cubin` the machine-code file. Returns the
/// number of entries that wait and one line for each that breaks the rule (empty: none).
pub(super) fn audit(ptx: &[u8], cubin: &std::path::Path) -> (usize, Vec<String>) {
    let entries = ptx_entries(&String::from_utf8_lossy(ptx));
    if entries.is_empty() {
        return (0, Vec::new());
    }
    let tool = cuobjdump();
    let run = std::process::Command::new(&tool).arg("-sass").arg(cubin).output();
    let run = run.unwrap_or_else(|e| panic!("{}: {e}", tool.display()));
    assert!(run.status.success(), "cuobjdump -sass {}: {}", cubin.display(), String::from_utf8_lossy(&run.stderr));
    let sass = sass_functions(&String::from_utf8_lossy(&run.stdout));
    (entries.len(), hoisted(&entries, &sass))
}

/// What a failed audit tells the developer.
pub(super) const RULE: &str = "read-only loads scheduled above the programmatic-launch wait: read what the launch before writes after \
    pdl_wait() through plain pointers or __ldcg, never through const __restrict__ or __ldg (ptxas may move those above the wait); \
    a load meant to run before the wait comes before it in the source (pdl_audit.rs)";
