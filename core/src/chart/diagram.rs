//! Diagrams of a definition besides Mermaid: Graphviz DOT ([`Definition::to_dot`]) and a
//! self-contained SVG drawn without Graphviz ([`Definition::to_svg`],
//! [`Definition::to_svg_highlighted`]).
//!
//! Both draw what Mermaid draws: every state by its key, compound and parallel states as boxes
//! around their children (regions of a parallel state side by side, divided by dashed lines),
//! final states with a double border, and one labelled edge per transition branch. A label
//! reads `EVENT (timer) [guard && guard] / action, action`; a targetless branch is a
//! self-loop. The SVG lists the edges next to the boxes instead of routing arrows, which keeps
//! the layout simple and every label readable.

use std::fmt::Write as _;

use super::configuration::Configuration;
use super::definition::{Branch, Definition, StateKind};

/// One drawn edge: the branch of a transition, from its state to its resolved target.
struct Edge {
    from: usize,
    to: usize,
    label: String,
}

impl Definition {
    /// Every transition branch in document order, with its resolved target (the source itself
    /// for a targetless branch) and its label.
    fn edges(&self) -> Vec<Edge> {
        let mut edges = Vec::new();
        for (s, node) in self.states.iter().enumerate() {
            // Branches are flattened in this order (events, then `@always`, `@done`, `@fail`,
            // `@timeout`), so the n-th branch written is the n-th resolved transition.
            let mut written: Vec<(String, &Branch)> = Vec::new();
            for t in &node.on {
                let timer = t.timer.as_ref().map(|spec| format!(" ({spec})")).unwrap_or_default();
                written.extend(t.branches.iter().map(|b| (format!("{}{timer}", t.event), b)));
            }
            written.extend(node.always.iter().map(|b| ("@always".to_owned(), b)));
            written.extend(node.on_done.iter().map(|b| ("@done".to_owned(), b)));
            written.extend(node.on_fail.iter().map(|b| ("@fail".to_owned(), b)));
            let timeout = node
                .delegation
                .as_ref()
                .and_then(|d| d.timeout)
                .map(|t| format!(" (after {t})"))
                .unwrap_or_default();
            written.extend(node.on_timeout.iter().map(|b| (format!("@timeout{timeout}"), b)));
            for ((trigger, branch), &t) in written.into_iter().zip(&node.transitions) {
                let mut label = trigger;
                if !branch.guards.is_empty() {
                    let _ = write!(label, " [{}]", branch.guards.join(" && "));
                }
                if !branch.actions.is_empty() {
                    let _ = write!(label, " / {}", branch.actions.join(", "));
                }
                let mut targets = self.drawn_targets(t);
                if targets.is_empty() {
                    targets.push(s);
                }
                for to in targets {
                    edges.push(Edge { from: s, to, label: label.clone() });
                }
            }
        }
        edges
    }

    /// Renders the chart as a Graphviz `digraph`: compound and parallel states are clusters,
    /// entered through a point node that edges attach to (clipped at the cluster's border).
    ///
    /// ```
    /// use keel_core::chart::Definition;
    /// let def = Definition::builder("door", 1)
    ///     .initial("closed")
    ///     .state("closed", |s| s.on_to("OPEN", "open"))
    ///     .state("open", |s| s.on_to("CLOSE", "closed"))
    ///     .build()
    ///     .unwrap();
    /// assert!(def.to_dot().contains("\"closed\" -> \"open\" [label=\"OPEN\"];"));
    /// ```
    pub fn to_dot(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "digraph {} {{", quote(&format!("{} v{}", self.name, self.version)));
        let _ = writeln!(out, "    label={};", quote(&format!("{} v{}", self.name, self.version)));
        out.push_str("    labelloc=t;\n    compound=true;\n    rankdir=LR;\n");
        out.push_str("    node [shape=box, style=rounded, fontname=\"Helvetica\"];\n");
        out.push_str("    edge [fontname=\"Helvetica\", fontsize=10];\n");
        out.push_str("    \".start\" [shape=point, width=0.15];\n");
        for &c in &self.states[0].children {
            self.dot_state(c, 1, &mut out);
        }
        if let Some(initial) = self.states[0].initial {
            let _ = writeln!(out, "    \".start\" -> {};", self.dot_edge_end(initial, "lhead"));
        }
        for edge in self.edges() {
            let mut attrs = vec![format!("label={}", quote(&edge.label))];
            let from = self.dot_attach(edge.from, "ltail", &mut attrs);
            let to = self.dot_attach(edge.to, "lhead", &mut attrs);
            let _ = writeln!(out, "    {from} -> {to} [{}];", attrs.join(", "));
        }
        out.push_str("}\n");
        out
    }

    fn dot_state(&self, s: usize, depth: usize, out: &mut String) {
        let pad = "    ".repeat(depth);
        let node = &self.states[s];
        let id = quote(&node.path);
        if node.children.is_empty() {
            let extra = if node.kind == StateKind::Final { ", peripheries=2" } else { "" };
            let _ = writeln!(out, "{pad}{id} [label={}{extra}];", quote(&node.key));
            return;
        }
        let _ = writeln!(out, "{pad}subgraph {} {{", quote(&format!("cluster_{}", node.path)));
        let style = if node.kind == StateKind::Parallel { "dashed" } else { "rounded" };
        let _ = writeln!(out, "{pad}    label={};\n{pad}    style={style};", quote(&node.key));
        // The point node stands for the state itself: edges attach to it, and for a compound
        // state it is the initial pseudo-state.
        let visible = if node.kind == StateKind::Parallel { ", style=invis" } else { "" };
        let _ = writeln!(out, "{pad}    {id} [shape=point, width=0.1{visible}];");
        for &c in &node.children {
            self.dot_state(c, depth + 1, out);
        }
        if let Some(initial) = node.initial {
            let _ = writeln!(out, "{pad}    {id} -> {};", self.dot_edge_end(initial, "lhead"));
        }
        let _ = writeln!(out, "{pad}}}");
    }

    /// The node an edge ending at `s` uses, with the clipping attribute for a cluster.
    fn dot_edge_end(&self, s: usize, which: &str) -> String {
        let mut attrs = Vec::new();
        let end = self.dot_attach(s, which, &mut attrs);
        if attrs.is_empty() { end } else { format!("{end} [{}]", attrs.join(", ")) }
    }

    fn dot_attach(&self, s: usize, which: &str, attrs: &mut Vec<String>) -> String {
        let path = self.path(s);
        if !self.states[s].children.is_empty() {
            attrs.push(format!("{which}={}", quote(&format!("cluster_{path}"))));
        }
        quote(path)
    }

    /// Renders the chart as a standalone SVG: states as nested boxes, transitions as a
    /// labelled edge list beside them.
    pub fn to_svg(&self) -> String {
        self.svg(None)
    }

    /// Like [`to_svg`](Self::to_svg), with the states of `active` filled and outlined so
    /// an instance's position reads at a glance. Every state box carries
    /// `data-state="<path>"`, and the active ones also the class `active`.
    pub fn to_svg_highlighted(&self, active: &Configuration) -> String {
        self.svg(Some(active))
    }
}

/// A DOT string literal.
fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Layout constants of the SVG, in pixels.
const CHAR_WIDTH: usize = 8;
const LEAF_HEIGHT: usize = 28;
const TITLE_HEIGHT: usize = 22;
const PAD: usize = 10;
const LINE_HEIGHT: usize = 18;

/// The size of a state's box.
struct Placed {
    width: usize,
    height: usize,
}

impl Definition {
    /// The size of the box of `s`: a leaf fits its key; a compound state stacks its children
    /// under a title; a parallel state puts its regions side by side.
    fn svg_size(&self, s: usize) -> Placed {
        let node = &self.states[s];
        let title = node.key.chars().count() * CHAR_WIDTH + 2 * PAD;
        if node.children.is_empty() {
            return Placed { width: title.max(60), height: LEAF_HEIGHT };
        }
        let sizes: Vec<Placed> = node.children.iter().map(|&c| self.svg_size(c)).collect();
        let (width, height) = if node.kind == StateKind::Parallel {
            (
                sizes.iter().map(|p| p.width).sum::<usize>() + PAD * (sizes.len() + 1),
                sizes.iter().map(|p| p.height).max().unwrap_or(0) + 2 * PAD,
            )
        } else {
            (
                sizes.iter().map(|p| p.width).max().unwrap_or(0) + 2 * PAD,
                sizes.iter().map(|p| p.height).sum::<usize>() + PAD * (sizes.len() + 1),
            )
        };
        Placed { width: width.max(title), height: height + TITLE_HEIGHT }
    }

    fn svg(&self, active: Option<&Configuration>) -> String {
        let root = &self.states[0];
        let sizes: Vec<Placed> = root.children.iter().map(|&c| self.svg_size(c)).collect();
        let boxes_width = sizes.iter().map(|p| p.width).max().unwrap_or(0) + 2 * PAD;
        let boxes_height = sizes.iter().map(|p| p.height).sum::<usize>() + PAD * (sizes.len() + 1);
        let edges = self.edges();
        let lines: Vec<String> = edges
            .iter()
            .map(|e| format!("{} → {} : {}", self.path(e.from), self.path(e.to), e.label))
            .collect();
        let list_x = boxes_width + 2 * PAD;
        let list_width = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) * 7 + 2 * PAD;
        let width = list_x + list_width;
        let height =
            (boxes_height + TITLE_HEIGHT).max(TITLE_HEIGHT + LINE_HEIGHT * (lines.len() + 2));
        let title = format!("{} v{}", self.name, self.version);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"13\">"
        );
        let _ = writeln!(out, "  <title>{}</title>", escape(&title));
        out.push_str(concat!(
            "  <style>\n",
            "    .state rect { fill: #ffffff; stroke: #555555; stroke-width: 1; }\n",
            "    .state.parallel > rect { stroke-dasharray: 6 3; }\n",
            "    .state.active > rect { fill: #ffe9a8; stroke: #c27c00; stroke-width: 2.5; }\n",
            "    .state.active > text { font-weight: bold; }\n",
            "    .region { stroke: #999999; stroke-dasharray: 4 3; }\n",
            "    .initial { fill: #333333; }\n",
            "    .edges text { font-size: 12px; }\n",
            "  </style>\n",
        ));
        let _ = writeln!(
            out,
            "  <text x=\"{PAD}\" y=\"16\" font-weight=\"bold\">{}</text>",
            escape(&title)
        );
        let mut y = TITLE_HEIGHT + PAD;
        for (&c, size) in root.children.iter().zip(&sizes) {
            if root.initial == Some(c) {
                let _ = writeln!(
                    out,
                    "  <circle class=\"initial\" cx=\"{}\" cy=\"{}\" r=\"3\"/>",
                    PAD / 2,
                    y + LEAF_HEIGHT / 2
                );
            }
            self.svg_state(c, PAD, y, active, 1, &mut out);
            y += size.height + PAD;
        }
        let _ =
            writeln!(out, "  <g class=\"edges\" transform=\"translate({list_x} {TITLE_HEIGHT})\">");
        let _ = writeln!(
            out,
            "    <text x=\"0\" y=\"{LINE_HEIGHT}\" font-weight=\"bold\">Transitions</text>"
        );
        for (i, line) in lines.iter().enumerate() {
            let _ = writeln!(
                out,
                "    <text x=\"0\" y=\"{}\">{}</text>",
                LINE_HEIGHT * (i + 2),
                escape(line)
            );
        }
        out.push_str("  </g>\n</svg>\n");
        out
    }

    fn svg_state(
        &self,
        s: usize,
        x: usize,
        y: usize,
        active: Option<&Configuration>,
        depth: usize,
        out: &mut String,
    ) {
        let node = &self.states[s];
        let size = self.svg_size(s);
        let pad = "  ".repeat(depth);
        let mut class = String::from("state");
        class.push_str(match node.kind {
            StateKind::Atomic => " atomic",
            StateKind::Compound => " compound",
            StateKind::Parallel => " parallel",
            StateKind::Final => " final",
        });
        if active.is_some_and(|a| a.contains(&node.path)) {
            class.push_str(" active");
        }
        let _ = writeln!(out, "{pad}<g class=\"{class}\" data-state=\"{}\">", escape(&node.path));
        let (width, height) = (size.width, size.height);
        let _ = writeln!(
            out,
            "{pad}  <rect x=\"{x}\" y=\"{y}\" width=\"{width}\" height=\"{height}\" rx=\"8\"/>"
        );
        if node.kind == StateKind::Final {
            let _ = writeln!(
                out,
                "{pad}  <rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" rx=\"6\" style=\"fill: none\"/>",
                x + 3,
                y + 3,
                width - 6,
                height - 6
            );
        }
        let key = escape(&node.key);
        if node.children.is_empty() {
            let _ = writeln!(
                out,
                "{pad}  <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{key}</text>",
                x + width / 2,
                y + LEAF_HEIGHT / 2 + 5
            );
            let _ = writeln!(out, "{pad}</g>");
            return;
        }
        let _ = writeln!(out, "{pad}  <text x=\"{}\" y=\"{}\">{key}</text>", x + PAD, y + 16);
        let top = y + TITLE_HEIGHT;
        if node.kind == StateKind::Parallel {
            let mut cx = x + PAD;
            for (i, &c) in node.children.iter().enumerate() {
                if i > 0 {
                    let line_x = cx - PAD / 2;
                    let _ = writeln!(
                        out,
                        "{pad}  <line class=\"region\" x1=\"{line_x}\" y1=\"{top}\" x2=\"{line_x}\" y2=\"{}\"/>",
                        y + height
                    );
                }
                self.svg_state(c, cx, top + PAD, active, depth + 1, out);
                cx += self.svg_size(c).width + PAD;
            }
        } else {
            let mut cy = top + PAD;
            for &c in &node.children {
                if node.initial == Some(c) {
                    // The initial pseudo-state: a dot left of the child that is entered first.
                    let _ = writeln!(
                        out,
                        "{pad}  <circle class=\"initial\" cx=\"{}\" cy=\"{}\" r=\"3\"/>",
                        x + PAD / 2,
                        cy + LEAF_HEIGHT / 2
                    );
                }
                self.svg_state(c, x + PAD, cy, active, depth + 1, out);
                cy += self.svg_size(c).height + PAD;
            }
        }
        let _ = writeln!(out, "{pad}</g>");
    }
}

/// Text for SVG/XML content and attributes.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::super::{Definition, Timer};

    fn chart() -> Definition {
        Definition::builder("quote\"d <chart>", 2)
            .guard("ok", |_, _| true)
            .initial("waiting")
            .state("waiting", |s| {
                s.machine("child")
                    .on_timeout(Timer::hours(1), |b| b.target("done").action("a<b"))
                    .on_done(|b| b.guard("ok").target("done"))
                    .on("SAY \"hi\"", |t| t.action("log"))
            })
            .final_state("done")
            .build()
            .unwrap()
    }

    #[test]
    fn dot_quotes_names_and_labels_every_kind_of_branch() {
        let dot = chart().to_dot();
        for line in [
            r#"digraph "quote\"d <chart> v2" {"#,
            r#"    ".start" -> "waiting";"#,
            r#"    "waiting" -> "waiting" [label="SAY \"hi\" / log"];"#,
            r#"    "waiting" -> "done" [label="@done [ok]"];"#,
            r#"    "waiting" -> "done" [label="@timeout (after 1 hour) / a<b"];"#,
            r#"    "done" [label="done", peripheries=2];"#,
        ] {
            assert!(dot.lines().any(|l| l == line), "missing {line}\n{dot}");
        }
    }

    #[test]
    fn svg_escapes_text_and_lists_every_branch() {
        let svg = chart().to_svg();
        assert!(svg.contains("<title>quote&quot;d &lt;chart&gt; v2</title>"), "{svg}");
        assert!(svg.contains(">waiting → done : @timeout (after 1 hour) / a&lt;b</text>"), "{svg}");
        assert!(svg.contains(">waiting → waiting : SAY &quot;hi&quot; / log</text>"), "{svg}");
        assert!(!svg.contains("a<b"), "raw markup in the SVG\n{svg}");
    }
}
