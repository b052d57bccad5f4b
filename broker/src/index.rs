//! The subscription index of the one path (ARCHITECTURE.md, "The broker's one path"): which
//! sessions a published topic reaches, once each, with the QoS, retain flag and Subscription
//! Identifiers MQTT 5 gives that delivery. Exact filters are found by the topic in a map; only
//! wildcard filters are walked, in a trie of topic levels.

// Topic levels are hashed on every publish; foldhash is several times faster than SipHash.
use foldhash::HashMap;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicUsize, Ordering};

use thiserror::Error;

/// A session as the registry numbers it; a new connection of the same client id that takes the
/// session over keeps its number.
pub type SessionId = u64;

/// When retained messages are sent for a subscription (MQTT 5.0 §3.8.3.1, Retain Handling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetainHandling {
    /// 0: at every SUBSCRIBE.
    OnSubscribe,
    /// 1: only when the subscription did not exist.
    OnNewSubscribe,
    /// 2: never.
    Never,
}

/// A subscription's options (MQTT 5.0 §3.8.3.1; MQTT 3.1.1 clients get the defaults besides QoS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The granted QoS: the most a delivery through this subscription gets.
    pub qos: u8,
    /// Not sent what the same session published.
    pub no_local: bool,
    /// Keep the publish's retain flag on delivery.
    pub retain_as_published: bool,
    pub retain_handling: RetainHandling,
    /// The Subscription Identifier the SUBSCRIBE carried, if any (§3.8.2.1.2).
    pub id: Option<u32>,
}

impl Options {
    /// An MQTT 3.1.1 subscription: QoS only.
    pub fn v4(qos: u8) -> Options {
        Options {
            qos,
            no_local: false,
            retain_as_published: false,
            retain_handling: RetainHandling::OnSubscribe,
            id: None,
        }
    }
}

/// A filter the index refuses (SUBACK 0x8F in MQTT 5, 0x80 in 3.1.1).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FilterError {
    #[error("empty topic filter")]
    Empty,
    #[error("'#' must be a whole level and the last one")]
    MultiLevel,
    #[error("'+' must be a whole level")]
    SingleLevel,
    #[error("a shared subscription needs a group name without '+', '#' or '/', then a filter")]
    Shared,
    #[error("No Local is not allowed on a shared subscription (MQTT 5.0 §3.8.3.1)")]
    SharedNoLocal,
}

/// One message for one session: a single copy for all of its matching non-shared subscriptions
/// (§3.3.4: the highest granted QoS among them, every Subscription Identifier), or one for a
/// shared subscription whose turn it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub session: SessionId,
    /// min(the publish's QoS, the granted QoS) (§3.8.4).
    pub qos: u8,
    /// The publish's retain flag where a matching subscription keeps it, else false (§3.3.1.3).
    pub retain: bool,
    pub subscription_ids: Vec<u32>,
}

/// Who holds one filter: sessions directly, and shared groups (`$share/<group>/<filter>`).
#[derive(Debug, Default)]
struct Holders {
    plain: Vec<(SessionId, Options)>,
    groups: Vec<Group>,
}

impl Holders {
    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.groups.is_empty()
    }
}

/// A shared subscription's members; each message goes to one of them in turn (§4.8.2).
#[derive(Debug)]
struct Group {
    name: Box<str>,
    members: Vec<(SessionId, Options)>,
    next: AtomicUsize,
}

/// A level of the wildcard trie; `+` and `#` are children like any other level.
#[derive(Debug, Default)]
struct Node {
    children: HashMap<Box<str>, Node>,
    holders: Holders,
}

impl Node {
    fn is_empty(&self) -> bool {
        self.children.is_empty() && self.holders.is_empty()
    }
}

/// Frees a subtree level by level: the derived drop recurses once per level, and a client
/// chooses how many levels a filter has.
impl Drop for Node {
    fn drop(&mut self) {
        let mut below: Vec<Node> = self.children.drain().map(|(_, node)| node).collect();
        while let Some(mut node) = below.pop() {
            below.extend(node.children.drain().map(|(_, node)| node));
        }
    }
}

/// The most levels and bytes a client's topic name or filter may have: the trie and each
/// subscription grow with them, so they are the operator's to bound (`broker.max_topic_levels`,
/// `broker.max_topic_bytes`); a `$share/<group>/` prefix counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopicBounds {
    pub max_levels: usize,
    pub max_bytes: usize,
}

impl TopicBounds {
    /// No bound but the protocol's (a UTF-8 string of at most 65,535 bytes).
    pub const PROTOCOL: TopicBounds = TopicBounds {
        max_levels: usize::MAX,
        max_bytes: usize::MAX,
    };

    /// Whether `name` (a topic or a filter) lies within the bounds.
    pub fn admit(&self, name: &str) -> bool {
        name.len() <= self.max_bytes
            && name.bytes().filter(|&b| b == b'/').count() < self.max_levels
    }
}

/// Every subscription on the node. Written on (un)subscribe and session end only; a publish
/// reads it, and a shared group's turn is an atomic, so routing needs no write lock.
#[derive(Debug, Default)]
pub struct Index {
    exact: HashMap<Box<str>, Holders>,
    wild: Node,
    count: usize,
    /// Bumped by every change, so an answer derived from the index can be kept until it moves.
    generation: u64,
}

/// A filter split into its share group (if any) and the filter proper.
struct Parsed<'a> {
    group: Option<&'a str>,
    filter: &'a str,
    wildcard: bool,
}

/// A filter split into its share group and the filter proper (§4.8.2): `$share/g/a/+` →
/// `(Some("g"), "a/+")`. Anything else, `$share/g` with no filter included, is returned whole
/// with no group; [`Index::subscribe`] refuses the malformed forms.
pub fn split_shared(filter: &str) -> (Option<&str>, &str) {
    match filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
    {
        Some((group, filter)) => (Some(group), filter),
        None => (None, filter),
    }
}

fn parse(filter: &str) -> Result<Parsed<'_>, FilterError> {
    let (group, filter) = split_shared(filter);
    let malformed = match group {
        Some(group) => group.is_empty() || filter.is_empty() || group.contains(['+', '#']),
        None => filter.starts_with("$share/"),
    };
    if malformed {
        return Err(FilterError::Shared);
    }
    if filter.is_empty() {
        return Err(FilterError::Empty);
    }
    let levels: Vec<&str> = filter.split('/').collect();
    let mut wildcard = false;
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') {
            if *level != "#" || i + 1 != levels.len() {
                return Err(FilterError::MultiLevel);
            }
            wildcard = true;
        } else if level.contains('+') {
            if *level != "+" {
                return Err(FilterError::SingleLevel);
            }
            wildcard = true;
        }
    }
    Ok(Parsed {
        group,
        filter,
        wildcard,
    })
}

/// Whether `filter` (without a share prefix) matches `topic`, level by level (§4.7): for one
/// filter against stored topics, as retained messages are matched; routing uses the index.
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut topic_levels = topic.split('/');
    let mut filter_levels = filter.split('/');
    loop {
        match (filter_levels.next(), topic_levels.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(f), Some(t)) if f == t => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether a topic name may be published to: not empty, no wildcard (§4.7.3, §3.3.2.1).
pub fn valid_topic(topic: &str) -> bool {
    !topic.is_empty() && !topic.contains(['+', '#', '\0'])
}

impl Index {
    /// Adds or replaces `session`'s subscription to `filter` (a SUBSCRIBE naming a filter the
    /// session holds replaces it, §3.8.4). Returns whether it is new, for Retain Handling 1.
    pub fn subscribe(
        &mut self,
        session: SessionId,
        filter: &str,
        options: Options,
    ) -> Result<bool, FilterError> {
        let parsed = parse(filter)?;
        if parsed.group.is_some() && options.no_local {
            return Err(FilterError::SharedNoLocal);
        }
        self.generation += 1;
        let holders = self.holders_mut(&parsed);
        let members = match parsed.group {
            None => &mut holders.plain,
            Some(name) => {
                let at = match holders.groups.iter().position(|g| &*g.name == name) {
                    Some(at) => at,
                    None => {
                        holders.groups.push(Group {
                            name: name.into(),
                            members: Vec::new(),
                            next: AtomicUsize::new(0),
                        });
                        holders.groups.len() - 1
                    }
                };
                &mut holders.groups[at].members
            }
        };
        let new = match members.iter_mut().find(|(s, _)| *s == session) {
            Some(held) => {
                held.1 = options;
                false
            }
            None => {
                members.push((session, options));
                true
            }
        };
        if new {
            self.count += 1;
        }
        Ok(new)
    }

    /// Removes `session`'s subscription to `filter`; false when it held none (UNSUBACK 0x11).
    pub fn unsubscribe(&mut self, session: SessionId, filter: &str) -> bool {
        let Ok(parsed) = parse(filter) else {
            return false;
        };
        self.generation += 1;
        let removed = if parsed.wildcard {
            let levels: Vec<&str> = parsed.filter.split('/').collect();
            remove_in_trie(&mut self.wild, &levels, parsed.group, session)
        } else {
            let Some(holders) = self.exact.get_mut(parsed.filter) else {
                return false;
            };
            let removed = remove_holder(holders, parsed.group, session);
            if holders.is_empty() {
                self.exact.remove(parsed.filter);
            }
            removed
        };
        if removed {
            self.count -= 1;
        }
        removed
    }

    /// How many subscriptions the index holds (shared members included).
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The deliveries of a message published by `publisher` (None: the node itself) to `topic`.
    pub fn route(
        &self,
        topic: &str,
        publisher: Option<SessionId>,
        qos: u8,
        retain: bool,
    ) -> Vec<Delivery> {
        let matched = self.matched(topic);
        let mut out: Vec<Delivery> =
            Vec::with_capacity(matched.iter().map(|h| h.plain.len() + h.groups.len()).sum());
        for holders in &matched {
            for group in &holders.groups {
                if group.members.is_empty() {
                    continue;
                }
                let turn = group.next.fetch_add(1, Ordering::Relaxed) % group.members.len();
                let (session, options) = &group.members[turn];
                out.push(Delivery {
                    session: *session,
                    qos: qos.min(options.qos),
                    retain: options.retain_as_published && retain,
                    subscription_ids: options.id.into_iter().collect(),
                });
            }
        }
        let shared = out.len();
        // Each holder lists a session once; only several holders can name it again.
        let mut holders_with_plain = 0;
        for holders in &matched {
            holders_with_plain += usize::from(!holders.plain.is_empty());
            for (session, options) in &holders.plain {
                // §3.8.3.1: No Local keeps a session's own messages from it.
                if options.no_local && publisher == Some(*session) {
                    continue;
                }
                out.push(Delivery {
                    session: *session,
                    qos: options.qos,
                    retain: options.retain_as_published && retain,
                    subscription_ids: options.id.into_iter().collect(),
                });
            }
        }
        if holders_with_plain > 1 {
            // §3.3.4: one copy per session, at the highest granted QoS, with every identifier.
            out[shared..].sort_by_key(|d| d.session);
            let mut kept = shared;
            for at in shared..out.len() {
                if kept > shared && out[kept - 1].session == out[at].session {
                    let later = std::mem::take(&mut out[at].subscription_ids);
                    let (qos_later, retain_later) = (out[at].qos, out[at].retain);
                    let held = &mut out[kept - 1];
                    held.qos = held.qos.max(qos_later);
                    held.retain |= retain_later;
                    held.subscription_ids.extend(later);
                } else {
                    out.swap(kept, at);
                    kept += 1;
                }
            }
            out.truncate(kept);
        }
        for delivery in &mut out[shared..] {
            delivery.qos = qos.min(delivery.qos);
        }
        out
    }

    /// Whether a session that `wanted` accepts subscribes to `topic`: builds no deliveries
    /// and takes no shared subscription's turn.
    pub fn reaches(&self, topic: &str, wanted: impl Fn(SessionId) -> bool) -> bool {
        let member = |(session, _): &(SessionId, Options)| wanted(*session);
        self.matched(topic).iter().any(|holders| {
            holders.plain.iter().any(member)
                || holders.groups.iter().any(|g| g.members.iter().any(member))
        })
    }

    /// Changes so far: equal generations mean an unchanged index.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The holders of every filter that matches `topic`. Inline room for the usual few
    /// matches and trie branches: a route allocates only what it returns.
    fn matched(&self, topic: &str) -> SmallVec<[&Holders; 8]> {
        let mut matched: SmallVec<[&Holders; 8]> = SmallVec::new();
        if let Some(holders) = self.exact.get(topic) {
            matched.push(holders);
        }
        if !self.wild.is_empty() {
            collect(&self.wild, topic, &mut matched);
        }
        matched
    }

    fn holders_mut(&mut self, parsed: &Parsed<'_>) -> &mut Holders {
        if !parsed.wildcard {
            return self.exact.entry(parsed.filter.into()).or_default();
        }
        let mut node = &mut self.wild;
        for level in parsed.filter.split('/') {
            node = node.children.entry(level.into()).or_default();
        }
        &mut node.holders
    }
}

/// Adds the holders of every wildcard filter in the trie under `root` that matches `topic`.
/// Walked with a stack, not recursion: the depth is the topic's, which a client chooses. Each
/// trie node is visited at most once (its path is one prefix of the topic's levels).
fn collect<'a>(root: &'a Node, topic: &str, out: &mut SmallVec<[&'a Holders; 8]>) {
    // §4.7.2: a topic starting with '$' is not matched by a filter starting with a wildcard.
    let dollar = topic.starts_with('$');
    // A node and the levels the topic has left below it (None: the topic ended at it).
    let mut stack: SmallVec<[(&'a Node, Option<&str>, bool); 8]> = SmallVec::new();
    stack.push((root, Some(topic), true));
    while let Some((node, rest, first)) = stack.pop() {
        let wildcards_allowed = !(dollar && first);
        if wildcards_allowed {
            // '#' matches the rest, and the parent level too (§4.7.1.2: "sport/#" matches
            // "sport").
            if let Some(hash) = node.children.get("#") {
                out.push(&hash.holders);
            }
        }
        let Some(rest) = rest else {
            out.push(&node.holders);
            continue;
        };
        // A plain byte scan: levels are short, and `split_once`'s searcher cost more than the
        // hash lookups it feeds.
        let (level, next) = match rest.bytes().position(|b| b == b'/') {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        if let Some(child) = node.children.get(level) {
            stack.push((child, next, false));
        }
        if wildcards_allowed {
            if let Some(plus) = node.children.get("+") {
                stack.push((plus, next, false));
            }
        }
    }
}

fn remove_holder(holders: &mut Holders, group: Option<&str>, session: SessionId) -> bool {
    let members = match group {
        None => &mut holders.plain,
        Some(name) => match holders.groups.iter_mut().find(|g| &*g.name == name) {
            Some(group) => &mut group.members,
            None => return false,
        },
    };
    let before = members.len();
    members.retain(|(s, _)| *s != session);
    let removed = members.len() != before;
    holders.groups.retain(|g| !g.members.is_empty());
    removed
}

/// Removes a holder under the trie path `levels`, pruning the levels it leaves empty. Two
/// walks down and no recursion: the depth is the filter's, which a client chooses.
fn remove_in_trie(
    root: &mut Node,
    levels: &[&str],
    group: Option<&str>,
    session: SessionId,
) -> bool {
    // The deepest node on the path that keeps something besides the path below it: if the
    // holder's node empties, the path is cut there.
    let mut cut = 0;
    let mut node = &*root;
    for (depth, level) in levels.iter().enumerate() {
        if node.children.len() > 1 || !node.holders.is_empty() {
            cut = depth;
        }
        match node.children.get(*level) {
            Some(child) => node = child,
            None => return false,
        }
    }
    let Some(held) = descend(root, levels) else {
        return false;
    };
    let removed = remove_holder(&mut held.holders, group, session);
    if removed && held.is_empty() {
        if let (Some(parent), Some(level)) = (descend(root, &levels[..cut]), levels.get(cut)) {
            // The cut subtree is one chain; its drop is iterative.
            parent.children.remove(*level);
        }
    }
    removed
}

/// The node at the end of the trie path `levels`, if it exists.
fn descend<'n>(root: &'n mut Node, levels: &[&str]) -> Option<&'n mut Node> {
    let mut node = root;
    for level in levels {
        node = node.children.get_mut(*level)?;
    }
    Some(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut deliveries: Vec<Delivery>) -> Vec<Delivery> {
        deliveries.sort_by_key(|d| d.session);
        for d in &mut deliveries {
            d.subscription_ids.sort_unstable();
        }
        deliveries
    }

    fn with_id(qos: u8, id: u32) -> Options {
        Options {
            id: Some(id),
            ..Options::v4(qos)
        }
    }

    #[test]
    fn qos_is_the_lower_of_the_publish_and_the_grant() {
        let mut index = Index::default();
        index.subscribe(1, "a/b", Options::v4(2)).unwrap();
        index.subscribe(2, "a/+", Options::v4(1)).unwrap();
        let got = sorted(index.route("a/b", None, 0, false));
        assert_eq!(got.iter().map(|d| d.qos).collect::<Vec<_>>(), [0, 0]);
        let got = sorted(index.route("a/b", None, 2, false));
        assert_eq!(got.iter().map(|d| d.qos).collect::<Vec<_>>(), [2, 1]);
    }

    #[test]
    fn overlapping_subscriptions_give_one_copy_with_every_identifier_at_the_highest_grant() {
        let mut index = Index::default();
        index.subscribe(7, "sensors/#", with_id(0, 1)).unwrap();
        index.subscribe(7, "sensors/+/temp", with_id(2, 2)).unwrap();
        index
            .subscribe(7, "sensors/room1/temp", Options::v4(1))
            .unwrap();
        let got = sorted(index.route("sensors/room1/temp", None, 2, false));
        assert_eq!(
            got,
            [Delivery {
                session: 7,
                qos: 2,
                retain: false,
                subscription_ids: vec![1, 2]
            }]
        );
    }

    #[test]
    fn no_local_keeps_a_sessions_own_messages_from_it() {
        let mut index = Index::default();
        let no_local = Options {
            no_local: true,
            ..Options::v4(1)
        };
        index.subscribe(1, "chat", no_local).unwrap();
        index.subscribe(2, "chat", Options::v4(1)).unwrap();
        let got = sorted(index.route("chat", Some(1), 1, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [2]);
        let got = sorted(index.route("chat", Some(2), 1, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn the_retain_flag_is_kept_only_for_retain_as_published() {
        let mut index = Index::default();
        let keep = Options {
            retain_as_published: true,
            ..Options::v4(1)
        };
        index.subscribe(1, "t", keep).unwrap();
        index.subscribe(2, "t", Options::v4(1)).unwrap();
        let got = sorted(index.route("t", None, 1, true));
        assert_eq!(
            got.iter().map(|d| d.retain).collect::<Vec<_>>(),
            [true, false]
        );
    }

    #[test]
    fn dollar_topics_are_not_matched_by_a_leading_wildcard() {
        let mut index = Index::default();
        index.subscribe(1, "#", Options::v4(0)).unwrap();
        index.subscribe(2, "+/events/#", Options::v4(0)).unwrap();
        index.subscribe(3, "$hw/events/#", Options::v4(0)).unwrap();
        let got = sorted(index.route("$hw/events/device/d1/twin/update", None, 0, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn multi_level_wildcard_matches_its_parent_level() {
        let mut index = Index::default();
        index.subscribe(1, "sport/#", Options::v4(0)).unwrap();
        index.subscribe(2, "sport/+", Options::v4(0)).unwrap();
        let got = sorted(index.route("sport", None, 0, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [1]);
        let got = sorted(index.route("sport/", None, 0, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn a_shared_group_takes_turns_and_each_group_gets_one_copy() {
        let mut index = Index::default();
        for session in [1, 2, 3] {
            index
                .subscribe(session, "$share/g/jobs/+", Options::v4(1))
                .unwrap();
        }
        index
            .subscribe(9, "$share/h/jobs/+", Options::v4(0))
            .unwrap();
        let mut turns = Vec::new();
        for _ in 0..6 {
            let got = index.route("jobs/1", None, 1, false);
            assert_eq!(got.len(), 2, "one member of each group");
            assert!(got.iter().any(|d| d.session == 9 && d.qos == 0));
            turns.extend(got.iter().filter(|d| d.session != 9).map(|d| d.session));
        }
        turns.sort_unstable();
        assert_eq!(turns, [1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn resubscribing_replaces_and_reports_it_is_not_new() {
        let mut index = Index::default();
        assert!(index.subscribe(1, "a/#", Options::v4(0)).unwrap());
        assert!(!index.subscribe(1, "a/#", Options::v4(2)).unwrap());
        assert_eq!(index.len(), 1);
        assert_eq!(index.route("a/b", None, 2, false)[0].qos, 2);
    }

    #[test]
    fn unsubscribing_frees_what_the_filter_held() {
        let mut index = Index::default();
        index.subscribe(1, "a/+/c/#", Options::v4(0)).unwrap();
        index.subscribe(1, "exact/topic", Options::v4(0)).unwrap();
        index
            .subscribe(2, "$share/g/a/+/c/#", Options::v4(0))
            .unwrap();
        assert!(index.unsubscribe(1, "a/+/c/#"));
        assert!(!index.unsubscribe(1, "a/+/c/#"));
        assert!(index.unsubscribe(1, "exact/topic"));
        assert!(index.unsubscribe(2, "$share/g/a/+/c/#"));
        assert!(index.is_empty());
        assert!(index.exact.is_empty() && index.wild.is_empty(), "{index:?}");
    }

    /// Levels a client cannot send over MQTT (a string has at most 65,535 bytes) but the
    /// index must survive anyway: no walk, removal or drop recurses per level.
    const DEEP: usize = 100_000;

    #[test]
    fn filters_and_topics_of_100_000_levels_are_routed_removed_and_dropped() {
        let mut index = Index::default();
        let plus = vec!["+"; DEEP].join("/");
        let hash = format!("{}/#", vec!["a"; DEEP - 1].join("/"));
        let exact = vec!["a"; DEEP].join("/");
        index.subscribe(1, &plus, Options::v4(1)).unwrap();
        index.subscribe(2, &hash, Options::v4(1)).unwrap();
        index.subscribe(3, &exact, Options::v4(1)).unwrap();
        index.subscribe(4, "a/+/#", Options::v4(1)).unwrap();
        let got = sorted(index.route(&exact, None, 1, false));
        assert_eq!(
            got.iter().map(|d| d.session).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        let deeper = format!("{exact}/a");
        let got = sorted(index.route(&deeper, None, 1, false));
        assert_eq!(got.iter().map(|d| d.session).collect::<Vec<_>>(), [2, 4]);
        assert!(index.unsubscribe(1, &plus));
        assert!(!index.unsubscribe(1, &plus));
        assert!(index.unsubscribe(3, &exact));
        assert_eq!(index.route(&exact, None, 1, false).len(), 2);
        assert!(index.unsubscribe(4, "a/+/#"));
        // The deep `#` filter is still held and freed with the index, iteratively.
        assert_eq!(index.len(), 1);
        drop(index);
    }

    #[test]
    fn removing_one_deep_filter_keeps_the_paths_others_share() {
        let mut index = Index::default();
        index.subscribe(1, "a/b/+/d", Options::v4(0)).unwrap();
        index.subscribe(2, "a/b/+", Options::v4(0)).unwrap();
        index.subscribe(3, "a/x/#", Options::v4(0)).unwrap();
        assert!(index.unsubscribe(1, "a/b/+/d"));
        assert_eq!(index.route("a/b/c", None, 0, false)[0].session, 2);
        assert_eq!(index.route("a/x/y", None, 0, false)[0].session, 3);
        assert!(index.unsubscribe(2, "a/b/+"));
        assert!(index.unsubscribe(3, "a/x/#"));
        assert!(index.wild.is_empty(), "{index:?}");
    }

    #[test]
    fn topic_bounds_count_levels_and_bytes() {
        let bounds = TopicBounds {
            max_levels: 3,
            max_bytes: 8,
        };
        assert!(bounds.admit("a/b/c") && bounds.admit("+/+/#"));
        assert!(!bounds.admit("a/b/c/d"), "four levels");
        assert!(!bounds.admit("abcdefghi"), "nine bytes");
        assert!(TopicBounds::PROTOCOL.admit(&"/".repeat(DEEP)));
    }

    #[test]
    fn invalid_filters_are_refused() {
        let mut index = Index::default();
        for (filter, error) in [
            ("", FilterError::Empty),
            ("a/#/b", FilterError::MultiLevel),
            ("a#", FilterError::MultiLevel),
            ("a/b+", FilterError::SingleLevel),
            ("$share/g", FilterError::Shared),
            ("$share//a", FilterError::Shared),
            ("$share/g+/a", FilterError::Shared),
        ] {
            assert_eq!(
                index.subscribe(1, filter, Options::v4(0)),
                Err(error),
                "{filter}"
            );
        }
        let no_local = Options {
            no_local: true,
            ..Options::v4(0)
        };
        assert_eq!(
            index.subscribe(1, "$share/g/a", no_local),
            Err(FilterError::SharedNoLocal)
        );
        assert!(index.is_empty());
        assert!(valid_topic("a/b") && !valid_topic("a/+") && !valid_topic(""));
    }
}

#[cfg(test)]
mod properties {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn level() -> impl Strategy<Value = String> {
        // Plain values: proptest reads a bare string as a regular expression.
        prop_oneof![Just("a"), Just("b"), Just(""), Just("$x")].prop_map(String::from)
    }

    fn topic() -> impl Strategy<Value = String> {
        proptest::collection::vec(level(), 1..4).prop_map(|l| l.join("/"))
    }

    fn filter() -> impl Strategy<Value = String> {
        (
            proptest::collection::vec(prop_oneof![level(), Just("+".to_string())], 0..4),
            any::<bool>(),
        )
            .prop_map(|(mut levels, hash)| {
                // A filter of one empty level is empty, which MQTT refuses.
                if hash || levels.concat().is_empty() && levels.len() < 2 {
                    levels.push("#".into());
                }
                levels.join("/")
            })
    }

    proptest! {
        #[test]
        fn routes_exactly_the_sessions_whose_filters_match(
            filters in proptest::collection::vec(filter(), 1..12),
            topics in proptest::collection::vec(topic(), 1..8),
        ) {
            let mut index = Index::default();
            for (session, f) in filters.iter().enumerate() {
                index.subscribe(session as SessionId, f, Options::v4(1)).unwrap();
            }
            for t in &topics {
                let routed: BTreeSet<SessionId> =
                    index.route(t, None, 1, false).iter().map(|d| d.session).collect();
                let expected: BTreeSet<SessionId> = filters
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| matches(f, t))
                    .map(|(s, _)| s as SessionId)
                    .collect();
                prop_assert_eq!(routed, expected, "topic {:?}", t);
            }
            for (session, f) in filters.iter().enumerate() {
                prop_assert!(index.unsubscribe(session as SessionId, f));
            }
            prop_assert!(index.is_empty());
        }
    }
}
