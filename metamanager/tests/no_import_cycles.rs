//! Keeps every workspace crate's modules free of import circles (issue 24): reads each crate's
//! `src/**/*.rs`, collects which file-module names which (`use` trees, and `crate::`, `super::`,
//! `self::` and child-module paths anywhere in the code), and fails on a circle, naming its files
//! and what ties them.
//!
//! Nodes are files. A path is followed through the modules it names to the file that defines its
//! item, through `use` re-exports (`crate::Error` is `error.rs` when the root `pub use`s it). A
//! file naming one of its own ancestor modules (`use super::Db` in `store/devices.rs`) is no edge:
//! the parent is the namespace its children live in, and re-exports them. Code inside a file's
//! inline modules counts as that file's, except `#[cfg(test)]` ones: unit tests may reach around.
//!
//! A reading of the source text, not of the compiler's: enough for this workspace's code, which
//! uses no `#[path]` attributes and no macros that name modules.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The crates checked, by their `src` folder relative to the workspace root.
const CRATES: &[&str] = &[
    "src",
    "broker/src",
    "metamanager/src",
    "bridges/src",
    "edged/src",
    "bench/src",
    "fakeapi/src",
    "kubewire/src",
    "metaserver/src",
    "edgecontroller/src",
    "protocol/src",
    "dmi/src",
];

#[test]
fn no_crate_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut report = String::new();
    for krate in CRATES {
        let src = root.join(krate);
        assert!(src.is_dir(), "{} is not a folder", src.display());
        for circle in circles(&src) {
            report.push_str(&format!("{krate}: {circle}\n"));
        }
    }
    assert!(report.is_empty(), "import circles:\n{report}");
}

#[test]
fn a_circle_is_found_and_named() {
    let dir = tempdir();
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n");
    write("a.rs", "use crate::b::{self, B};\npub struct A(B);\n");
    // Through a re-export at the root, and a path in an expression.
    write(
        "b.rs",
        "pub struct B;\nfn f() { let _ = crate::c::C::new(); }\n",
    );
    write(
        "c/mod.rs",
        "mod inner;\npub use inner::C;\n#[cfg(test)]\nmod tests { use crate::a::A; }\n",
    );
    write(
        "c/inner.rs",
        "// use crate::b; (a comment)\nuse super::Nothing;\npub struct C(crate::A);\nconst S: &str = \"crate::b::B\";\n",
    );
    let found = circles(&dir);
    assert_eq!(
        found,
        ["3 files (a.rs, b.rs, c/inner.rs), e.g. \
          a.rs -> b.rs (crate::b) -> c/inner.rs (crate::c::C::new) -> a.rs (crate::A)"],
    );
    // Without the tie back, no circle.
    write("c/inner.rs", "pub struct C;\n");
    assert!(circles(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "edgemeta-cycles-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

type ModPath = Vec<String>;

/// One parsed file: what it declares and names.
struct File {
    /// `src`-relative path, for messages.
    name: String,
    /// Its module path (`store/mod.rs` → `[store]`).
    module: ModPath,
    /// Inline modules, by their full module path.
    inline: Vec<ModPath>,
    /// `use` items: (module they are in, imported name, full path).
    uses: Vec<(ModPath, Option<String>, Vec<String>)>,
    /// Paths named outside `use` items: (module they are in, path).
    paths: Vec<(ModPath, Vec<String>)>,
}

/// Every circle among `src`'s files, as `a -> b (path) -> ... -> a (path)`.
fn circles(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    collect(src, src, &mut files);
    files.sort_by(|a, b| a.name.cmp(&b.name));
    let mut modules: HashMap<ModPath, usize> = HashMap::new();
    for (i, file) in files.iter().enumerate() {
        modules.insert(file.module.clone(), i);
    }
    for (i, file) in files.iter().enumerate() {
        for inline in &file.inline {
            modules.entry(inline.clone()).or_insert(i);
        }
    }
    let mut uses: HashMap<(ModPath, String), (ModPath, Vec<String>)> = HashMap::new();
    for file in &files {
        for (module, name, path) in &file.uses {
            if let Some(name) = name {
                uses.insert(
                    (module.clone(), name.clone()),
                    (module.clone(), path.clone()),
                );
            }
        }
    }
    let index = Index {
        modules: &modules,
        uses: &uses,
    };
    // edges[from][to] = the first path that ties them.
    let mut edges: Vec<BTreeMap<usize, String>> = vec![BTreeMap::new(); files.len()];
    for (from, file) in files.iter().enumerate() {
        let named = file
            .uses
            .iter()
            .map(|(m, _, p)| (m, p))
            .chain(file.paths.iter().map(|(m, p)| (m, p)));
        for (module, path) in named {
            let Some(to) = index.resolve(module, path, 0) else {
                continue;
            };
            let target = &files[to].module;
            if to == from || file.module.starts_with(target) {
                continue;
            }
            edges[from].entry(to).or_insert_with(|| path.join("::"));
        }
    }
    let mut found = Vec::new();
    for component in strongly_connected(&edges) {
        if component.len() < 2 {
            continue;
        }
        let names: Vec<&str> = component.iter().map(|&f| files[f].name.as_str()).collect();
        found.push(format!(
            "{} files ({}), e.g. {}",
            names.len(),
            names.join(", "),
            describe(&component, &edges, &files)
        ));
    }
    found
}

/// One circle through `component` (first file first), with the path tying each step.
fn describe(component: &[usize], edges: &[BTreeMap<usize, String>], files: &[File]) -> String {
    let inside: BTreeSet<usize> = component.iter().copied().collect();
    let start = *inside.iter().next().unwrap();
    // Breadth-first from `start` back to `start`, inside the component.
    let mut came_from: HashMap<usize, usize> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    let mut closing = None;
    while let Some(at) = queue.pop_front() {
        for &next in edges[at].keys().filter(|n| inside.contains(n)) {
            if next == start {
                closing = Some(at);
                break;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = came_from.entry(next) {
                e.insert(at);
                queue.push_back(next);
            }
        }
        if closing.is_some() {
            break;
        }
    }
    let mut chain = Vec::new();
    let mut at = closing.expect("a component of two or more files has a circle");
    while at != start {
        chain.push(at);
        at = came_from[&at];
    }
    chain.reverse();
    let mut steps = vec![start];
    steps.extend(chain);
    steps.push(start);
    let mut text = files[start].name.clone();
    for pair in steps.windows(2) {
        text.push_str(&format!(
            " -> {} ({})",
            files[pair[1]].name, edges[pair[0]][&pair[1]]
        ));
    }
    text
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &[BTreeMap<usize, String>]) -> Vec<Vec<usize>> {
    struct Walk<'a> {
        edges: &'a [BTreeMap<usize, String>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(w: &mut Walk<'_>, v: usize) {
        w.index[v] = Some(w.next);
        w.low[v] = w.next;
        w.next += 1;
        w.stack.push(v);
        w.on_stack[v] = true;
        let targets: Vec<usize> = w.edges[v].keys().copied().collect();
        for t in targets {
            match w.index[t] {
                None => {
                    visit(w, t);
                    w.low[v] = w.low[v].min(w.low[t]);
                }
                Some(i) if w.on_stack[t] => w.low[v] = w.low[v].min(i),
                Some(_) => {}
            }
        }
        if Some(w.low[v]) == w.index[v] {
            let mut component = Vec::new();
            loop {
                let t = w.stack.pop().unwrap();
                w.on_stack[t] = false;
                component.push(t);
                if t == v {
                    break;
                }
            }
            component.sort_unstable();
            w.out.push(component);
        }
    }
    let n = edges.len();
    let mut w = Walk {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if w.index[v].is_none() {
            visit(&mut w, v);
        }
    }
    w.out.sort();
    w.out
}

struct Index<'a> {
    modules: &'a HashMap<ModPath, usize>,
    uses: &'a HashMap<(ModPath, String), (ModPath, Vec<String>)>,
}

impl Index<'_> {
    /// The file defining what `path`, named in module `from`, names; `None` outside the crate.
    fn resolve(&self, from: &ModPath, path: &[String], depth: usize) -> Option<usize> {
        if depth > 16 || path.is_empty() {
            return None;
        }
        let (mut current, rest): (ModPath, &[String]) = match path[0].as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (from.clone(), &path[1..]),
            "super" => {
                let mut current = from.clone();
                let mut i = 0;
                while path.get(i).map(String::as_str) == Some("super") {
                    current.pop();
                    i += 1;
                }
                (current, &path[i..])
            }
            first => {
                let mut child = from.clone();
                child.push(first.to_owned());
                if self.modules.contains_key(&child) {
                    (from.clone(), path)
                } else if let Some((module, target)) =
                    self.uses.get(&(from.clone(), first.to_owned()))
                {
                    // `use crate::devices;` then `devices::apply`.
                    let mut full = target.clone();
                    full.extend_from_slice(&path[1..]);
                    return self.resolve(module, &full, depth + 1);
                } else {
                    return None;
                }
            }
        };
        for segment in rest {
            if segment == "self" {
                break;
            }
            let mut child = current.clone();
            child.push(segment.clone());
            if self.modules.contains_key(&child) {
                current = child;
                continue;
            }
            if let Some((module, target)) = self.uses.get(&(current.clone(), segment.clone())) {
                if let Some(file) = self.resolve(module, target, depth + 1) {
                    return Some(file);
                }
            }
            break;
        }
        self.modules.get(&current).copied()
    }
}

fn collect(src: &Path, dir: &Path, files: &mut Vec<File>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            // `src/bin/*.rs` are crate roots of their own, not modules of this one.
            if path != src.join("bin") {
                collect(src, &path, files);
            }
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let relative = path.strip_prefix(src).unwrap();
        let mut module: ModPath = relative
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
            .collect();
        let last = module.last().map(String::as_str);
        if last == Some("mod") || module.len() == 1 && matches!(last, Some("lib" | "main")) {
            module.pop();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        files.push(parse(
            relative.to_string_lossy().replace('\\', "/"),
            module,
            &text,
        ));
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

fn parse(name: String, module: ModPath, text: &str) -> File {
    let tokens = tokenize(text);
    let mut file = File {
        name,
        module: module.clone(),
        inline: Vec::new(),
        uses: Vec::new(),
        paths: Vec::new(),
    };
    // Inline modules open: (their path, the brace depth inside them, whether under
    // `#[cfg(test)]`).
    let mut stack: Vec<(ModPath, usize, bool)> = vec![(module, 0, false)];
    let mut depth = 0;
    let mut i = 0;
    while i < tokens.len() {
        let current = stack.last().unwrap().0.clone();
        let testing = stack.last().unwrap().2;
        match &tokens[i] {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                if stack.len() > 1 && stack.last().unwrap().1 == depth {
                    stack.pop();
                }
                depth -= 1;
            }
            Token::Ident(word) if word == "mod" => {
                if let (Some(Token::Ident(child)), Some(Token::Punct('{'))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    let mut path = current.clone();
                    path.push(child.clone());
                    file.inline.push(path.clone());
                    depth += 1;
                    stack.push((path, depth, testing || after_cfg_test(&tokens[..i])));
                    i += 3;
                    continue;
                }
            }
            Token::Ident(word) if word == "use" => {
                let mut j = i + 1;
                let mut found = Vec::new();
                use_tree(&tokens, &mut j, Vec::new(), &mut found);
                for (path, alias) in found {
                    if !testing {
                        file.uses.push((current.clone(), alias, path));
                    }
                }
                i = j;
                continue;
            }
            Token::Ident(_) if i == 0 || tokens[i - 1] != Token::Sep => {
                let mut path = Vec::new();
                let mut j = i;
                while let Some(Token::Ident(segment)) = tokens.get(j) {
                    path.push(segment.clone());
                    if tokens.get(j + 1) != Some(&Token::Sep) {
                        break;
                    }
                    j += 2;
                }
                if path.len() > 1 {
                    if !testing {
                        file.paths.push((current.clone(), path));
                    }
                    i = j + 1;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    file
}

/// Whether `before` ends in `#[cfg(test)]` (the attribute of the item that follows).
fn after_cfg_test(before: &[Token]) -> bool {
    let ident = |s: &str| Token::Ident(s.to_owned());
    let attribute = [
        Token::Punct('#'),
        Token::Punct('['),
        ident("cfg"),
        Token::Punct('('),
        ident("test"),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    before.ends_with(&attribute)
        || before.ends_with(&[attribute.as_slice(), &[ident("pub")]].concat())
}

/// Reads one use tree at `tokens[*at]` under `prefix`; pushes each (path, imported name).
fn use_tree(
    tokens: &[Token],
    at: &mut usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    if tokens.get(*at) == Some(&Token::Sep) {
        *at += 1;
    }
    loop {
        match tokens.get(*at) {
            Some(Token::Ident(segment)) => {
                prefix.push(segment.clone());
                *at += 1;
                if tokens.get(*at) == Some(&Token::Sep) {
                    *at += 1;
                    continue;
                }
                let mut name = prefix.last().cloned();
                if name.as_deref() == Some("self") {
                    prefix.pop();
                    name = prefix.last().cloned();
                }
                if let (Some(Token::Ident(word)), Some(Token::Ident(alias))) =
                    (tokens.get(*at), tokens.get(*at + 1))
                {
                    if word == "as" {
                        name = Some(alias.clone()).filter(|a| a != "_");
                        *at += 2;
                    }
                }
                out.push((prefix, name));
                break;
            }
            Some(Token::Punct('*')) => {
                *at += 1;
                out.push((prefix, None));
                break;
            }
            Some(Token::Punct('{')) => {
                *at += 1;
                while !matches!(tokens.get(*at), Some(Token::Punct('}')) | None) {
                    use_tree(tokens, at, prefix.clone(), out);
                    if tokens.get(*at) == Some(&Token::Punct(',')) {
                        *at += 1;
                    }
                }
                *at += 1;
                break;
            }
            _ => break,
        }
    }
    // The `;` of the item, when this was the whole tree.
    if tokens.get(*at) == Some(&Token::Punct(';')) {
        *at += 1;
    }
}

/// Identifiers, `::` and single punctuation; comments, strings, chars, lifetimes and numbers
/// dropped.
fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut nesting = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    nesting += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    nesting -= 1;
                    i += 2;
                    if nesting == 0 {
                        break;
                    }
                } else if i >= chars.len() {
                    break;
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(&chars, i + 1);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label.
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let raw = matches!(word.as_str(), "r" | "br");
            let byte = matches!(word.as_str(), "b");
            if raw && (at(i) == '"' || at(i) == '#') {
                // A raw string: r"..." or r#"..."#.
                let mut hashes = 0;
                while at(i) == '#' {
                    hashes += 1;
                    i += 1;
                }
                if at(i) == '"' {
                    i += 1;
                    loop {
                        if i >= chars.len() {
                            break;
                        }
                        if chars[i] == '"' && (1..=hashes).all(|h| at(i + h) == '#') {
                            i += 1 + hashes;
                            break;
                        }
                        i += 1;
                    }
                } else {
                    // `r#ident`: a raw identifier.
                    let start = i;
                    while at(i).is_alphanumeric() || at(i) == '_' {
                        i += 1;
                    }
                    tokens.push(Token::Ident(chars[start..i].iter().collect()));
                }
            } else if byte && at(i) == '"' {
                i = skip_string(&chars, i + 1);
            } else if byte && at(i) == '\'' {
                i += 1;
                if at(i) == '\\' {
                    i += 1;
                }
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else {
                tokens.push(Token::Ident(word));
            }
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric()
                || at(i) == '_'
                || at(i) == '.' && at(i + 1).is_ascii_digit()
            {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            tokens.push(Token::Sep);
            i += 2;
        } else {
            tokens.push(Token::Punct(c));
            i += 1;
        }
    }
    tokens
}

/// The index after the closing quote of a string whose body starts at `i`.
fn skip_string(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}
