//! SCXML import of the structural subset: [`ChartBuilder::from_scxml`].
//!
//! What is read: `<scxml>`, `<state>`, `<parallel>`, `<final>`, `<history>` (shallow and
//! deep), the `initial` attribute and `<initial>` element (naming a direct child),
//! `<transition>` with `event` (one or more names separated by spaces, matched exactly),
//! `cond` (the name of a guard registered in Rust), `target` (one or more ids separated by
//! spaces) and `type="internal"`, and `<onentry>` / `<onexit>` / transition content made of
//! `<raise event="…"/>` and named actions written `<keel:action name="…"/>` in the namespace
//! [`KEEL_SCXML_NAMESPACE`]. Everything else — the data model, expressions, `<script>`,
//! `<assign>`, `<send>`, `<invoke>`, `<log>`, conditionals, wildcard events, any other
//! element, any other attribute without a namespace and any attribute in Keel's own
//! namespace (`keel:machine`, `keel:after`: timers and delegation are added in Rust or the
//! JSON form) — is refused with an error naming the element and its line, so a document is
//! never run with part of its meaning dropped. Attributes in other namespaces (an editor's
//! layout metadata, say) are ignored: they carry nothing Keel would run.
//!
//! SCXML ids are global while Keel paths are dotted keys from the top, so each state's key is
//! its id (which therefore must not contain `.`) and targets are rewritten to full paths.

use std::collections::BTreeMap;

use roxmltree::{Document, Node};

use super::algorithm::RAISE_ACTION_PREFIX;
use super::definition::{BranchBuilder, ChartBuilder, HistoryDepth, StateBuilder, StateKind};
use crate::limits;

/// The XML namespace of Keel's own SCXML elements (`<keel:action name="…"/>`).
pub const KEEL_SCXML_NAMESPACE: &str = "urn:keel:scxml";

const SCXML_NAMESPACE: &str = "http://www.w3.org/2005/07/scxml";

/// Why an SCXML document was refused: the element, its line and what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SCXML line {line}, <{element}>: {problem}; fix: {fix}")]
pub struct ScxmlError {
    /// 1-based line of the element (or of the XML syntax error).
    pub line: u32,
    /// The element's name (`document` for XML syntax errors).
    pub element: String,
    /// What is wrong.
    pub problem: String,
    /// How to fix it.
    pub fix: String,
}

impl ChartBuilder {
    /// Reads a chart from an SCXML document (see the module docs for the subset). The chart
    /// is named by the `name` attribute of `<scxml>` (`scxml` without one) at `version`.
    /// Register the guards that `cond` attributes name, then [`build`](Self::build).
    ///
    /// ```
    /// use keel_core::chart::ChartBuilder;
    /// let scxml = r#"<scxml xmlns="http://www.w3.org/2005/07/scxml" version="1.0" name="door" initial="closed">
    ///   <state id="closed"><transition event="OPEN" cond="unlocked" target="open"/></state>
    ///   <state id="open"><transition event="CLOSE" target="closed"/></state>
    /// </scxml>"#;
    /// let def = ChartBuilder::from_scxml(scxml, 1).unwrap().guard("unlocked", |_, _| true).build().unwrap();
    /// assert_eq!(def.event_alphabet(), ["CLOSE", "OPEN"]);
    /// ```
    pub fn from_scxml(text: &str, version: u32) -> Result<ChartBuilder, ScxmlError> {
        if text.len() > limits::DEFINITION_SCXML_BYTES_MAX {
            return Err(ScxmlError {
                line: 1,
                element: "document".to_owned(),
                problem: format!(
                    "is {} bytes, more than the {} allowed",
                    text.len(),
                    limits::DEFINITION_SCXML_BYTES_MAX
                ),
                fix: "split the chart into child machines".to_owned(),
            });
        }
        let doc = Document::parse(text).map_err(|e| ScxmlError {
            line: e.pos().row,
            element: "document".to_owned(),
            problem: format!("is not well-formed XML ({e})"),
            fix: "correct the XML syntax".to_owned(),
        })?;
        let root = doc.root_element();
        let importer = Importer { doc: &doc, paths: BTreeMap::new() };
        if root.tag_name().name() != "scxml" || !Importer::is_scxml(root) {
            return Err(importer.error(
                root,
                "is not an SCXML document root".to_owned(),
                "make <scxml xmlns=\"http://www.w3.org/2005/07/scxml\"> the root element",
            ));
        }
        let mut importer = importer;
        importer.collect_paths(root, "", 0)?;
        importer.check_attributes(root, &["version", "name", "initial", "datamodel", "binding"])?;
        if let Some(model) = root.attribute("datamodel").filter(|m| *m != "null") {
            return Err(importer.error(
                root,
                format!("uses datamodel `{model}`"),
                "drop the data model: Keel keeps data in the chart context and binds guards and actions in Rust",
            ));
        }
        let name = root.attribute("name").unwrap_or("scxml");
        let mut top = StateBuilder::new("", StateKind::Compound);
        top = importer.children(root, top)?;
        let mut builder = ChartBuilder::new(name, version);
        builder.root = top;
        Ok(builder)
    }
}

struct Importer<'a, 'input> {
    doc: &'a Document<'input>,
    /// State and history ids to their dotted Keel paths.
    paths: BTreeMap<String, String>,
}

impl Importer<'_, '_> {
    fn error(&self, node: Node<'_, '_>, problem: String, fix: &str) -> ScxmlError {
        ScxmlError {
            line: self.doc.text_pos_at(node.range().start).row,
            element: node.tag_name().name().to_owned(),
            problem,
            fix: fix.to_owned(),
        }
    }

    fn is_scxml(node: Node<'_, '_>) -> bool {
        matches!(node.tag_name().namespace(), None | Some(SCXML_NAMESPACE))
    }

    fn is_keel(node: Node<'_, '_>) -> bool {
        node.tag_name().namespace() == Some(KEEL_SCXML_NAMESPACE)
    }

    fn refuse(&self, node: Node<'_, '_>) -> ScxmlError {
        let name = node.tag_name().name();
        let fix = match name {
            "datamodel" | "data" | "assign" | "script" => {
                "keep data in the chart context and change it from named actions (<keel:action name=\"…\"/>) bound in Rust"
            }
            "send" | "cancel" | "invoke" | "finalize" | "content" | "param" => {
                "use a named action for messages to other systems, or a delegation state built in Rust for child machines"
            }
            "if" | "elseif" | "else" | "foreach" | "log" | "donedata" => {
                "express the choice as guarded transitions and the effect as a named action"
            }
            _ => "remove it; only the structural subset of SCXML is imported",
        };
        self.error(node, "is outside the supported SCXML subset".to_owned(), fix)
    }

    fn check_attributes(&self, node: Node<'_, '_>, allowed: &[&str]) -> Result<(), ScxmlError> {
        for a in node.attributes() {
            if a.namespace() == Some(KEEL_SCXML_NAMESPACE) {
                return Err(self.error(
                    node,
                    format!(
                        "has attribute `keel:{}`; Keel reads no attribute in its own namespace, so it would be dropped",
                        a.name()
                    ),
                    "timers, delegation and the like are not read from SCXML: add them in Rust on the imported builder, or use the JSON form",
                ));
            }
            if a.namespace().is_none() && !allowed.contains(&a.name()) {
                return Err(self.error(
                    node,
                    format!("has attribute `{}`, which is outside the supported subset", a.name()),
                    &format!("remove it; this element supports {}", allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }

    fn id<'n>(&self, node: Node<'n, '_>) -> Result<&'n str, ScxmlError> {
        match node.attribute("id") {
            Some(id) if !id.is_empty() && !id.contains('.') && !id.contains(' ') => Ok(id),
            Some(id) => Err(self.error(
                node,
                format!("has id `{id}`, which Keel cannot use as a state key"),
                "use an id without `.` or spaces",
            )),
            None => Err(self.error(
                node,
                "has no id".to_owned(),
                "give every state, parallel, final and history element an id",
            )),
        }
    }

    /// First pass: the dotted path of every state and history id, so that targets can be
    /// rewritten whatever their document order.
    fn collect_paths(
        &mut self,
        node: Node<'_, '_>,
        prefix: &str,
        depth: usize,
    ) -> Result<(), ScxmlError> {
        if depth > limits::SCXML_DEPTH_MAX {
            return Err(self.error(
                node,
                format!("is nested more than {} states deep", limits::SCXML_DEPTH_MAX),
                "flatten the chart or split it into child machines",
            ));
        }
        for child in elements(node) {
            if !Self::is_scxml(child) {
                continue;
            }
            if !matches!(child.tag_name().name(), "state" | "parallel" | "final" | "history") {
                continue;
            }
            let id = self.id(child)?;
            let path = if prefix.is_empty() { id.to_owned() } else { format!("{prefix}.{id}") };
            if self.paths.insert(id.to_owned(), path.clone()).is_some() {
                return Err(self.error(
                    child,
                    format!("reuses id `{id}`"),
                    "give every state a distinct id",
                ));
            }
            self.collect_paths(child, &path, depth + 1)?;
        }
        Ok(())
    }

    fn target_paths(&self, node: Node<'_, '_>, ids: &str) -> Result<String, ScxmlError> {
        let mut out = Vec::new();
        for id in ids.split_whitespace() {
            match self.paths.get(id) {
                Some(path) => out.push(path.clone()),
                None => {
                    return Err(self.error(
                        node,
                        format!("targets unknown id `{id}`"),
                        "name the id of a state, parallel, final or history element",
                    ));
                }
            }
        }
        Ok(out.join(" "))
    }

    /// Adds the child states, transitions and entry/exit content of `node` to `state`. The
    /// first pass has already bounded the nesting depth this recursion follows.
    fn children(
        &self,
        node: Node<'_, '_>,
        mut state: StateBuilder,
    ) -> Result<StateBuilder, ScxmlError> {
        let mut first_child: Option<String> = None;
        let mut initial: Option<String> = None;
        if let Some(ids) = node.attribute("initial") {
            initial = Some(self.initial_key(node, node, ids)?);
        }
        for child in elements(node) {
            if Self::is_keel(child) || !Self::is_scxml(child) {
                return Err(self.refuse(child));
            }
            match child.tag_name().name() {
                name @ ("state" | "parallel" | "final") => {
                    let id = self.id(child)?;
                    first_child.get_or_insert_with(|| id.to_owned());
                    let kind = match name {
                        "parallel" => StateKind::Parallel,
                        "final" => StateKind::Final,
                        _ => StateKind::Atomic,
                    };
                    let allowed: &[&str] =
                        if name == "state" { &["id", "initial"] } else { &["id"] };
                    self.check_attributes(child, allowed)?;
                    let built = self.children(child, StateBuilder::new(id, kind))?;
                    state = state.child(built);
                }
                "history" => {
                    self.check_attributes(child, &["id", "type"])?;
                    let depth_kind = match child.attribute("type").unwrap_or("shallow") {
                        "shallow" => HistoryDepth::Shallow,
                        "deep" => HistoryDepth::Deep,
                        other => {
                            return Err(self.error(
                                child,
                                format!("has type `{other}`"),
                                "use type=\"shallow\" or type=\"deep\"",
                            ));
                        }
                    };
                    let default = self.history_default(child)?;
                    state = state.history(self.id(child)?, depth_kind, default);
                }
                "initial" => {
                    self.check_attributes(child, &[])?;
                    let transitions: Vec<Node<'_, '_>> = elements(child).collect();
                    let [t] = transitions[..] else {
                        return Err(self.error(
                            child,
                            "must hold exactly one <transition>".to_owned(),
                            "write <initial><transition target=\"child id\"/></initial>",
                        ));
                    };
                    if t.tag_name().name() != "transition" || elements(t).next().is_some() {
                        return Err(self.error(
                            t,
                            "is not a plain transition (the initial transition carries no content here)".to_owned(),
                            "write <transition target=\"child id\"/> and move actions to <onentry>",
                        ));
                    }
                    self.check_attributes(t, &["target"])?;
                    let ids = t.attribute("target").unwrap_or_default();
                    initial = Some(self.initial_key(t, node, ids)?);
                }
                "transition" => state = self.transition(child, state)?,
                "onentry" => {
                    self.check_attributes(child, &[])?;
                    for action in self.content(child)? {
                        state = state.entry(action);
                    }
                }
                "onexit" => {
                    self.check_attributes(child, &[])?;
                    for action in self.content(child)? {
                        state = state.exit(action);
                    }
                }
                _ => return Err(self.refuse(child)),
            }
        }
        // SCXML enters the first child in document order when no initial is named.
        if state.kind != StateKind::Parallel
            && let Some(key) = initial.or(first_child)
        {
            state = state.initial(key);
        }
        Ok(state)
    }

    /// The key of the direct child that `ids` names as the initial state of `parent`.
    fn initial_key(
        &self,
        at: Node<'_, '_>,
        parent: Node<'_, '_>,
        ids: &str,
    ) -> Result<String, ScxmlError> {
        let direct = elements(parent)
            .filter(|c| matches!(c.tag_name().name(), "state" | "parallel" | "final"))
            .any(|c| c.attribute("id") == Some(ids));
        if direct {
            Ok(ids.to_owned())
        } else {
            Err(self.error(
                at,
                format!("names initial `{ids}`, which is not one direct child state"),
                "name one direct child as the initial state (deeper states follow their own initial)",
            ))
        }
    }

    /// The default transition of a history element, as target paths.
    fn history_default(&self, history: Node<'_, '_>) -> Result<String, ScxmlError> {
        let transitions: Vec<Node<'_, '_>> = elements(history).collect();
        let [t] = transitions[..] else {
            return Err(self.error(
                history,
                "must hold exactly one <transition> (its default)".to_owned(),
                "add <transition target=\"…\"/> naming the state entered when nothing is recorded",
            ));
        };
        if t.tag_name().name() != "transition" || elements(t).next().is_some() {
            return Err(self.error(
                t,
                "is not a plain default transition".to_owned(),
                "write <transition target=\"…\"/> without content",
            ));
        }
        self.check_attributes(t, &["target"])?;
        self.target_paths(t, t.attribute("target").unwrap_or_default())
    }

    fn transition(
        &self,
        node: Node<'_, '_>,
        mut state: StateBuilder,
    ) -> Result<StateBuilder, ScxmlError> {
        self.check_attributes(node, &["event", "cond", "target", "type"])?;
        let internal = match node.attribute("type") {
            None | Some("external") => false,
            Some("internal") => true,
            Some(other) => {
                return Err(self.error(
                    node,
                    format!("has type `{other}`"),
                    "use type=\"internal\" or type=\"external\"",
                ));
            }
        };
        let target = match node.attribute("target") {
            Some(ids) => Some(self.target_paths(node, ids)?),
            None => None,
        };
        let actions = self.content(node)?;
        let branch = |mut b: BranchBuilder| {
            if let Some(cond) = node.attribute("cond") {
                b = b.guard(cond);
            }
            for a in &actions {
                b = b.action(a.clone());
            }
            if let Some(t) = &target {
                b = b.target(t.clone());
            }
            if internal {
                b = b.internal();
            }
            b
        };
        match node.attribute("event") {
            None => Ok(state.always(branch)),
            Some(events) => {
                let names: Vec<&str> = events.split_whitespace().collect();
                if names.is_empty() {
                    return Err(self.error(
                        node,
                        "has an empty event attribute".to_owned(),
                        "name the event, or drop the attribute for an eventless transition",
                    ));
                }
                for name in names {
                    if name.contains('*') || name.ends_with('.') {
                        return Err(self.error(
                            node,
                            format!(
                                "uses event descriptor `{name}`; Keel matches event names exactly"
                            ),
                            "list every event name the transition handles",
                        ));
                    }
                    let name = self.event_name(name);
                    state = state.on(name, |t| t.branch(branch));
                }
                Ok(state)
            }
        }
    }

    /// The Keel name of an SCXML event: `done.state.<id>` becomes `done.state.<path>`,
    /// because the core names done events by the state's dotted path.
    fn event_name(&self, name: &str) -> String {
        name.strip_prefix("done.state.")
            .and_then(|id| self.paths.get(id))
            .map_or_else(|| name.to_owned(), |path| format!("done.state.{path}"))
    }

    /// The executable content of `node` as action names: `<raise>` becomes the core's built-in
    /// raise action, `<keel:action>` its named action.
    fn content(&self, node: Node<'_, '_>) -> Result<Vec<String>, ScxmlError> {
        let mut out = Vec::new();
        for child in elements(node) {
            if Self::is_keel(child) && child.tag_name().name() == "action" {
                self.check_attributes(child, &["name"])?;
                match child.attribute("name").filter(|n| !n.is_empty() && !n.starts_with('@')) {
                    Some(name) => out.push(name.to_owned()),
                    None => {
                        return Err(self.error(
                            child,
                            "has no usable name".to_owned(),
                            "name the action bound in Rust, e.g. <keel:action name=\"charge\"/>, not starting with `@`",
                        ));
                    }
                }
            } else if Self::is_scxml(child) && child.tag_name().name() == "raise" {
                self.check_attributes(child, &["event"])?;
                match child.attribute("event").filter(|e| !e.trim().is_empty()) {
                    Some(event) => out.push(format!("{RAISE_ACTION_PREFIX}{event}")),
                    None => {
                        return Err(self.error(
                            child,
                            "has no event".to_owned(),
                            "name the raised event, e.g. <raise event=\"done\"/>",
                        ));
                    }
                }
            } else {
                return Err(self.refuse(child));
            }
        }
        Ok(out)
    }
}

/// The element children of `node`, in document order.
fn elements<'n, 'i>(node: Node<'n, 'i>) -> impl Iterator<Item = Node<'n, 'i>> {
    node.children().filter(Node::is_element)
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use super::*;
    use crate::chart::Definition;

    fn doc(body: &str) -> String {
        format!(
            "<scxml xmlns=\"http://www.w3.org/2005/07/scxml\" xmlns:keel=\"urn:keel:scxml\" version=\"1.0\" name=\"t\">\n{body}\n</scxml>"
        )
    }

    #[test]
    fn the_structural_subset_builds_the_same_chart_as_the_builder() {
        let text = doc(r#"<state id="p" initial="b">
              <history id="h" type="deep"><transition target="a"/></history>
              <onentry><keel:action name="hello"/><raise event="ready"/></onentry>
              <state id="a"/>
              <state id="b"><transition event="GO DASH" cond="ok" target="h" type="internal"/></state>
              <transition event="done.state.p" target="end"/>
            </state>
            <parallel id="q"><state id="r1"/><state id="r2"/><onexit><keel:action name="bye"/></onexit></parallel>
            <final id="end"/>"#);
        let imported =
            ChartBuilder::from_scxml(&text, 3).expect("imports").guard("ok", |_, _| true);
        let written = Definition::builder("t", 3)
            .guard("ok", |_, _| true)
            .initial("p")
            .state("p", |s| {
                s.initial("b")
                    .history("h", HistoryDepth::Deep, "p.a")
                    .entry("hello")
                    .entry("@raise:ready")
                    .leaf("a")
                    .state("b", |s| {
                        s.on("GO", |t| t.branch(|b| b.guard("ok").target("p.h").internal()))
                            .on("DASH", |t| t.branch(|b| b.guard("ok").target("p.h").internal()))
                    })
                    .on("done.state.p", |t| t.branch(|b| b.target("end")))
            })
            .parallel("q", |s| s.leaf("r1").leaf("r2").exit("bye"))
            .final_state("end");
        let (imported, written) =
            (imported.build().expect("valid"), written.build().expect("valid"));
        assert!(imported.same_structure(&written), "{imported:?}\n{written:?}");
        assert_eq!(imported.action_names(), ["bye", "hello"]);
    }

    /// An editor's metadata in its own namespace carries nothing Keel runs: it is ignored.
    #[test]
    fn attributes_in_other_namespaces_are_ignored() {
        let text = doc(
            r#"<state id="a" xmlns:qt="urn:qt-editor" qt:geometry="0;0;10;10"><transition event="E" target="b" qt:label="go"/></state><final id="b"/>"#,
        );
        let def = ChartBuilder::from_scxml(&text, 1).expect("imports").build().expect("valid");
        assert_eq!(def.event_alphabet(), ["E"]);
    }

    #[test]
    fn the_first_child_is_initial_when_none_is_named() {
        let text = doc(
            r#"<state id="x"><initial><transition target="x2"/></initial><state id="x1"/><state id="x2"/></state><state id="y"/>"#,
        );
        let def = ChartBuilder::from_scxml(&text, 1).expect("imports").build().expect("valid");
        let json = def.to_json();
        assert!(json.contains(r#""initial": "x""#), "{json}");
        assert!(json.contains(r#""initial": "x2""#), "{json}");
    }

    #[test]
    fn everything_outside_the_subset_is_refused_with_element_and_line() {
        let cases = [
            (doc(r#"<datamodel><data id="x"/></datamodel>"#), 2, "datamodel"),
            (
                doc("<state id=\"a\">\n<onentry><script>x = 1</script></onentry></state>"),
                3,
                "script",
            ),
            (
                doc(
                    "<state id=\"a\">\n<onentry>\n<send event=\"x\" target=\"#_parent\"/></onentry></state>",
                ),
                4,
                "send",
            ),
            (doc(r#"<state id="a"><invoke src="child.scxml"/></state>"#), 2, "invoke"),
            (
                doc(r#"<state id="a"><onexit><assign location="x" expr="1"/></onexit></state>"#),
                2,
                "assign",
            ),
            (
                doc(r#"<state id="a"><transition event="E"><log expr="1"/></transition></state>"#),
                2,
                "log",
            ),
            (
                doc(r#"<state id="a"><onentry><my:thing xmlns:my="urn:x"/></onentry></state>"#),
                2,
                "thing",
            ),
            (
                doc(r#"<state id="a"><transition event="error.*" target="a"/></state>"#),
                2,
                "transition",
            ),
            (
                doc(r#"<state id="a"><transition event="E" targetexpr="x"/></state>"#),
                2,
                "transition",
            ),
            (
                doc(r#"<state id="a"><transition event="E" target="nowhere"/></state>"#),
                2,
                "transition",
            ),
            (doc(r#"<state id="a.b"/>"#), 2, "state"),
            (doc("<state/>"), 2, "state"),
            (doc(r#"<state id="a"/><state id="a"/>"#), 2, "state"),
            (
                doc(r#"<state id="a" initial="c"><state id="b"><state id="c"/></state></state>"#),
                2,
                "state",
            ),
            (doc(r#"<state id="a"><history id="h"/><state id="b"/></state>"#), 2, "history"),
            (doc(r#"<state id="a"><onentry><keel:action/></onentry></state>"#), 2, "action"),
            // Keel's own namespace carries no attributes: dropping one would change the
            // meaning (a delegation, a timer), so it is refused.
            (
                doc(
                    "<state id=\"a\" keel:machine=\"payment\" keel:timeout=\"5m\">\n<transition event=\"E\" target=\"b\"/></state><state id=\"b\"/>",
                ),
                2,
                "state",
            ),
            (
                doc(
                    "<state id=\"a\">\n<transition event=\"E\" target=\"b\" keel:after=\"10s\"/></state><state id=\"b\"/>",
                ),
                3,
                "transition",
            ),
            ("<scxml><state id=\"a\"></scxml>".to_owned(), 1, "document"),
            ("<html/>".to_owned(), 1, "html"),
        ];
        for (text, line, element) in cases {
            let error = ChartBuilder::from_scxml(&text, 1).expect_err(&text);
            assert_eq!((error.line, error.element.as_str()), (line, element), "{error}");
            let message = error.to_string();
            assert!(message.contains("; fix: "), "{message}");
        }
        let mut huge = doc("");
        huge.push_str(&" ".repeat(limits::DEFINITION_SCXML_BYTES_MAX));
        let error = ChartBuilder::from_scxml(&huge, 1).expect_err("too large");
        assert!(error.problem.contains("bytes"), "{error}");
    }

    #[test]
    fn nesting_is_bounded() {
        let depth = limits::SCXML_DEPTH_MAX + 2;
        let mut body = String::new();
        for i in 0..depth {
            let _ = write!(body, "<state id=\"s{i}\">");
        }
        body.push_str(&"</state>".repeat(depth));
        let error = ChartBuilder::from_scxml(&doc(&body), 1).expect_err("too deep");
        assert!(error.problem.contains("nested more than"), "{error}");
    }
}
