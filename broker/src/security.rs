//! Who may connect (username/password, anonymous) and what each identity may publish and
//! subscribe to (topic ACL). Each connection's task (`conn/`) applies these rules to every
//! CONNECT, PUBLISH and SUBSCRIBE it decodes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use std::net::IpAddr;
use std::sync::Arc;

use argon2::password_hash::{PasswordHash, PasswordHasher, SaltString};
use argon2::Argon2;
use serde::Deserialize;

use crate::dollar;
use crate::login::{memory_kib, CheckConfig, Checker, Verdict, Who};

/// Whether no client may use `topic` (or the filter a subscription shares), whatever its
/// rights: `$` topics other than the carried ones are the broker's own, and so is the ACL's key
/// form `edgemeta$...`, so clients name `$hw/...` one way only, the way ACL rules are written.
pub(crate) fn reserved(topic: &str) -> bool {
    topic.starts_with(dollar::INTERNAL_PREFIX)
        || (topic.starts_with('$') && !dollar::is_carried(topic.as_bytes()))
}

/// Whether a client with `grants` may publish to `topic`.
pub(crate) fn publishable(grants: &Grants, topic: &str) -> bool {
    !reserved(topic) && grants.may_publish(topic)
}

/// Authentication settings (`broker.auth`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Whether clients may connect without a username.
    #[serde(default = "default_true")]
    pub allow_anonymous: bool,
    /// Users by name; `password_hash` comes from `edgemeta passwd`.
    #[serde(default)]
    pub users: BTreeMap<String, UserConfig>,
    /// How password checks run and how failing clients are held off.
    #[serde(default)]
    pub checks: CheckConfig,
}

/// One user.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// An argon2 PHC string (`$argon2id$v=19$...`).
    pub password_hash: String,
}

/// Topic access control (`broker.acl`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AclConfig {
    /// Off: every client may publish and subscribe anything (a trusted local network).
    #[serde(default)]
    pub enabled: bool,
    /// Usernames that act as these edge modules (publish as `<root>/meta/<m>/...`, read `<root>/<m>/#`).
    #[serde(default = "default_modules")]
    pub modules: Vec<String>,
    /// Extra permissions, added to the built-in module and device rules.
    #[serde(default)]
    pub rules: Vec<AclRule>,
}

/// Extra permissions for the identities whose username matches `identity`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AclRule {
    /// A username, a prefix ending in `*`, `*` for every authenticated user, or `anonymous`.
    pub identity: String,
    /// Topic filters the identity may publish to; `%u` is its username, `%c` its client id.
    #[serde(default)]
    pub publish: Vec<String>,
    /// Topic filters the identity may subscribe to (a subscription must lie inside one).
    #[serde(default)]
    pub subscribe: Vec<String>,
}

const fn default_true() -> bool {
    true
}
fn default_modules() -> Vec<String> {
    ["edged", "edgemesh", "edgefunction"]
        .map(String::from)
        .to_vec()
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            allow_anonymous: true,
            users: BTreeMap::new(),
            checks: CheckConfig::default(),
        }
    }
}

impl Default for AclConfig {
    fn default() -> Self {
        AclConfig {
            enabled: false,
            modules: default_modules(),
            rules: Vec::new(),
        }
    }
}

/// Hashes `password` for `broker.auth.users.<name>.password_hash`.
pub fn hash_password(password: &str) -> Result<String, String> {
    let salt =
        SaltString::encode_b64(uuid::Uuid::new_v4().as_bytes()).map_err(|e| e.to_string())?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| e.to_string())
}

/// Counts of refused operations, shared by every connection of the broker.
#[derive(Debug, Default)]
struct Denials {
    publishes: AtomicU64,
    subscribes: AtomicU64,
}

/// The checked form of the auth and ACL settings.
#[derive(Debug)]
pub struct Policy {
    root: String,
    allow_anonymous: bool,
    users: BTreeMap<String, Arc<str>>,
    checker: Checker,
    acl: Option<AclConfig>,
    max_subscriptions: usize,
    denials: Denials,
}

/// Who a connection is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `None` for an anonymous client.
    pub username: Option<String>,
    pub client_id: String,
}

/// What one connection may do, worked out once at CONNECT.
#[derive(Debug, Clone, Default)]
pub struct Grants {
    /// `None`: everything (ACL off).
    publish: Option<Vec<String>>,
    subscribe: Option<Vec<String>>,
}

impl Policy {
    /// Checks the settings; errors name the offending key.
    pub fn new(
        root: &str,
        auth: &AuthConfig,
        acl: &AclConfig,
        max_subscriptions: usize,
    ) -> Result<Policy, String> {
        for (name, user) in &auth.users {
            if name.is_empty() {
                return Err("broker.auth.users has an empty user name".into());
            }
            PasswordHash::new(&user.password_hash).map_err(|e| {
                format!("broker.auth.users.{name}.password_hash is not an argon2 hash ({e}); make one with `edgemeta passwd`")
            })?;
            let kib = memory_kib(&user.password_hash).map_err(|e| {
                format!(
                    "broker.auth.users.{name}.password_hash has invalid argon2 parameters ({e})"
                )
            })?;
            if kib > auth.checks.max_hash_kib {
                return Err(format!(
                    "broker.auth.users.{name}.password_hash asks for {kib} KiB per check, more than broker.auth.checks.max_hash_kib ({})",
                    auth.checks.max_hash_kib
                ));
            }
        }
        auth.checks.validate()?;
        for (i, rule) in acl.rules.iter().enumerate() {
            if rule.identity.is_empty() {
                return Err(format!("broker.acl.rules[{i}].identity is empty"));
            }
        }
        Ok(Policy {
            root: root.to_owned(),
            allow_anonymous: auth.allow_anonymous,
            users: auth
                .users
                .iter()
                .map(|(name, user)| (name.clone(), Arc::from(user.password_hash.as_str())))
                .collect(),
            checker: Checker::new(auth.checks.clone()),
            acl: acl.enabled.then(|| acl.clone()),
            max_subscriptions,
            denials: Denials::default(),
        })
    }

    /// Whether credentials are checked at all.
    pub fn needs_login_check(&self) -> bool {
        !self.users.is_empty() || !self.allow_anonymous
    }

    /// Checks a username and password from `peer`; an empty username is the anonymous
    /// client. argon2 runs on the checker's own threads, never on the caller's.
    pub(crate) async fn check_login(
        &self,
        peer: Option<IpAddr>,
        username: &str,
        client_id: &str,
        password: String,
    ) -> Verdict {
        if username.is_empty() {
            return if self.allow_anonymous {
                Verdict::Admitted
            } else {
                Verdict::Refused
            };
        }
        let Some(hash) = self.users.get(username) else {
            return Verdict::Refused;
        };
        let who = Who {
            peer,
            user: username,
            client_id,
        };
        self.checker.check(who, hash.clone(), password).await
    }

    pub fn max_subscriptions(&self) -> usize {
        self.max_subscriptions
    }

    /// What `identity` may do.
    pub fn grants(&self, identity: &Identity) -> Grants {
        let Some(acl) = &self.acl else {
            return Grants::default();
        };
        let root = &self.root;
        let (mut publish, mut subscribe) = match &identity.username {
            Some(user) if acl.modules.contains(user) => (
                vec![
                    format!("{root}/meta/{user}/#"),
                    format!("{root}/cloud/{user}/#"),
                ],
                vec![format!("{root}/{user}/#")],
            ),
            _ => (
                vec![format!("{root}/meta/device/#")],
                vec![format!("{root}/device/#")],
            ),
        };
        // Rules are written as clients see topics; grants are checked against the ACL key.
        let grant = |filter: &String| {
            let filter = substitute(
                filter,
                identity.username.as_deref().unwrap_or(""),
                &identity.client_id,
            )?;
            Some(dollar::to_broker(&filter).into_owned())
        };
        for rule in acl
            .rules
            .iter()
            .filter(|r| rule_applies(&r.identity, identity))
        {
            publish.extend(rule.publish.iter().filter_map(grant));
            subscribe.extend(rule.subscribe.iter().filter_map(grant));
        }
        Grants {
            publish: Some(publish),
            subscribe: Some(subscribe),
        }
    }

    pub(crate) fn count_denied_publish(&self) -> u64 {
        self.denials.publishes.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn count_denied_subscribe(&self) -> u64 {
        self.denials.subscribes.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Publishes and subscribes the ACL (or the subscription cap) refused so far.
    pub fn denials(&self) -> (u64, u64) {
        (
            self.denials.publishes.load(Ordering::Relaxed),
            self.denials.subscribes.load(Ordering::Relaxed),
        )
    }
}

/// `filter` with `%u` replaced by `user` and `%c` by `client_id`, in one pass (a name holding
/// `%c` stays a name). `None` when a name it uses is empty or holds `+` or `#`: a user named `+`
/// must not get every device's subtree.
fn substitute(filter: &str, user: &str, client_id: &str) -> Option<String> {
    let mut out = String::with_capacity(filter.len());
    let mut rest = filter;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let name = match rest.get(at..at + 2) {
            Some("%u") => user,
            Some("%c") => client_id,
            _ => {
                out.push('%');
                rest = &rest[at + 1..];
                continue;
            }
        };
        if name.is_empty() || name.contains(['+', '#']) {
            return None;
        }
        out.push_str(name);
        rest = &rest[at + 2..];
    }
    out.push_str(rest);
    Some(out)
}

fn rule_applies(pattern: &str, identity: &Identity) -> bool {
    match (&identity.username, pattern) {
        (None, "anonymous") => true,
        (None, _) => false,
        (Some(_), "*") => true,
        (Some(user), pattern) => match pattern.strip_suffix('*') {
            Some(prefix) => user.starts_with(prefix),
            None => user == pattern,
        },
    }
}

impl Grants {
    /// Whether a client may publish to `topic`, matched as its ACL key ([`dollar::to_broker`]).
    pub fn may_publish(&self, topic: &str) -> bool {
        match &self.publish {
            None => true,
            Some(filters) => {
                let topic = dollar::to_broker(topic);
                filters.iter().any(|f| crate::index::matches(f, &topic))
            }
        }
    }

    /// A subscription is allowed when its ACL key lies inside an allowed filter.
    pub fn may_subscribe(&self, filter: &str) -> bool {
        match &self.subscribe {
            None => true,
            Some(allowed) => {
                let filter = dollar::to_broker(filter);
                allowed.iter().any(|a| filter_within(&filter, a))
            }
        }
    }
}

/// Whether every topic `filter` can match is also matched by `allowed`.
fn filter_within(filter: &str, allowed: &str) -> bool {
    let mut wanted = filter.split('/');
    for level in allowed.split('/') {
        match (level, wanted.next()) {
            ("#", _) => return true,
            (_, None) => return false,
            (_, Some("#")) => return false,
            ("+", Some(_)) => {}
            (a, Some(w)) if a == w && w != "+" => {}
            _ => return false,
        }
    }
    wanted.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(acl: AclConfig, auth: AuthConfig) -> Policy {
        Policy::new("ke", &auth, &acl, 100).unwrap()
    }

    fn secure() -> Policy {
        let acl = AclConfig {
            enabled: true,
            rules: vec![AclRule {
                identity: "sensor-*".into(),
                publish: vec!["site/%u/#".into()],
                subscribe: vec!["site/%c/#".into()],
            }],
            ..AclConfig::default()
        };
        policy(acl, AuthConfig::default())
    }

    fn user(name: &str) -> Identity {
        Identity {
            username: Some(name.into()),
            client_id: format!("{name}-client"),
        }
    }

    #[test]
    fn with_the_acl_off_everything_is_allowed() {
        let grants = policy(AclConfig::default(), AuthConfig::default()).grants(&user("x"));
        assert!(grants.may_publish("ke/meta/edgecontroller/insert/a/b/c"));
        assert!(grants.may_subscribe("#"));
    }

    #[test]
    fn a_device_publishes_only_as_device_and_reads_only_device_replies() {
        let grants = secure().grants(&user("thermometer"));
        assert!(grants.may_publish("ke/meta/device/update/default/devicestatus/t1"));
        for topic in [
            "ke/meta/edgecontroller/insert/default/pod/x",
            "ke/meta/edged/update/default/podstatus/x",
            "ke/cloud/device/x",
            "ke/edged/meta/response/a/b",
        ] {
            assert!(!grants.may_publish(topic), "{topic}");
        }
        assert!(grants.may_subscribe("ke/device/#"));
        assert!(grants.may_subscribe("ke/device/meta/response/+/+/+"));
        for filter in ["ke/cloud/#", "ke/#", "#", "ke/+/meta/#", "ke/edged/#"] {
            assert!(!grants.may_subscribe(filter), "{filter}");
        }
    }

    #[test]
    fn anonymous_clients_are_devices_even_when_their_client_id_names_a_module() {
        let anonymous = Identity {
            username: None,
            client_id: "edged".into(),
        };
        let grants = secure().grants(&anonymous);
        assert!(!grants.may_publish("ke/meta/edged/update/default/podstatus/x"));
        assert!(grants.may_publish("ke/meta/device/update/a/b/c"));
    }

    #[test]
    fn a_module_acts_only_as_itself() {
        let grants = secure().grants(&user("edged"));
        assert!(grants.may_publish("ke/meta/edged/update/default/podstatus/x"));
        assert!(grants.may_publish("ke/cloud/edged/update/default/podstatus/x"));
        assert!(!grants.may_publish("ke/meta/edgecontroller/insert/default/pod/x"));
        assert!(!grants.may_publish("ke/meta/edgemesh/insert/default/service/x"));
        assert!(grants.may_subscribe("ke/edged/#"));
        assert!(!grants.may_subscribe("ke/edgemesh/#"));
    }

    #[test]
    fn rules_substitute_username_and_client_id() {
        let grants = secure().grants(&user("sensor-7"));
        assert!(grants.may_publish("site/sensor-7/temp"));
        assert!(!grants.may_publish("site/sensor-8/temp"));
        assert!(grants.may_subscribe("site/sensor-7-client/#"));
        assert!(!grants.may_subscribe("site/#"));
    }

    /// Devices `dev-*` own `$hw/events/device/<name>/#`; `mapper` reads every device.
    fn devices() -> Policy {
        let acl = AclConfig {
            enabled: true,
            rules: vec![
                AclRule {
                    identity: "dev-*".into(),
                    publish: vec![
                        "$hw/events/device/%u/#".into(),
                        "$ke/events/device/%u/#".into(),
                    ],
                    subscribe: vec!["$hw/events/device/%u/#".into()],
                },
                AclRule {
                    identity: "mapper".into(),
                    publish: vec![],
                    subscribe: vec!["$hw/events/device/#".into()],
                },
                AclRule {
                    identity: "anonymous".into(),
                    publish: vec!["$hw/events/device/%u/#".into()],
                    subscribe: vec!["$hw/events/device/%c/#".into()],
                },
            ],
            ..AclConfig::default()
        };
        policy(acl, AuthConfig::default())
    }

    #[test]
    fn rules_in_client_form_grant_the_carried_dollar_topics() {
        let grants = devices().grants(&user("dev-a"));
        assert!(grants.may_publish("$hw/events/device/dev-a/twin/update"));
        assert!(grants.may_publish("$ke/events/device/dev-a/data/update"));
        assert!(!grants.may_publish("$hw/events/device/dev-b/twin/update"));
        assert!(!grants.may_publish("$hw/events/node/n/membership/get"));
        assert!(grants.may_subscribe("$hw/events/device/dev-a/#"));
        assert!(grants.may_subscribe("$hw/events/device/dev-a/twin/+"));
        for filter in [
            "$hw/events/device/dev-b/#",
            "$hw/events/device/#",
            "$hw/#",
            "#",
        ] {
            assert!(!grants.may_subscribe(filter), "{filter}");
        }
        let mapper = devices().grants(&user("mapper"));
        assert!(mapper.may_subscribe("$hw/events/device/+/twin/update/result"));
        assert!(!mapper.may_subscribe("$ke/events/device/#"));
    }

    #[test]
    fn a_name_with_a_wildcard_or_no_name_gets_nothing_from_rules_that_use_it() {
        for name in ["dev-+", "dev-#", "dev-a/#", "dev-+/x"] {
            let grants = devices().grants(&user(name));
            for topic in ["$hw/events/device/dev-a/twin/update", "$hw/events/device/x"] {
                assert!(!grants.may_publish(topic), "{name} → {topic}");
            }
            assert!(!grants.may_subscribe("$hw/events/device/dev-a/#"), "{name}");
        }
        // Anonymous: `%u` is empty, so only the `%c` rule applies.
        let anonymous = Identity {
            username: None,
            client_id: "sensor".into(),
        };
        let grants = devices().grants(&anonymous);
        assert!(!grants.may_publish("$hw/events/device//x"));
        assert!(grants.may_subscribe("$hw/events/device/sensor/#"));
        let wild = Identity {
            username: None,
            client_id: "+".into(),
        };
        assert!(!devices()
            .grants(&wild)
            .may_subscribe("$hw/events/device/x/#"));
    }

    #[test]
    fn a_two_level_device_id_is_a_username() {
        let grants = devices().grants(&user("dev-ns/thermo"));
        assert!(grants.may_publish("$hw/events/device/dev-ns/thermo/state/update"));
        assert!(!grants.may_publish("$hw/events/device/dev-ns/other/state/update"));
    }

    #[test]
    fn names_are_substituted_once() {
        assert_eq!(
            substitute("a/%u/%c/%x%", "%c", "id").as_deref(),
            Some("a/%c/id/%x%")
        );
        assert_eq!(substitute("a/%c", "", "id").as_deref(), Some("a/id"));
        assert_eq!(substitute("a/%u", "", "id"), None);
        assert_eq!(substitute("a/%uñ", "b", "id").as_deref(), Some("a/bñ"));
        assert_eq!(substitute("a/%ñ", "b", "id").as_deref(), Some("a/%ñ"));
    }

    #[test]
    fn filters_within_filters() {
        assert!(filter_within("a/b/c", "a/#"));
        assert!(filter_within("a/+/c", "a/+/c"));
        assert!(!filter_within("a/+/c", "a/b/c"));
        assert!(!filter_within("a/#", "a/b/#"));
        assert!(filter_within("a/b/#", "a/b/#"));
        assert!(!filter_within("a", "a/b"));
        assert!(!filter_within("a/b/c", "a/b"));
    }

    #[test]
    fn passwords_verify_against_their_hash_only() {
        let hash = hash_password("hunter2").unwrap();
        let mut users = BTreeMap::new();
        users.insert(
            "bob".to_owned(),
            UserConfig {
                password_hash: hash,
            },
        );
        let p = policy(
            AclConfig::default(),
            AuthConfig {
                allow_anonymous: false,
                users,
                checks: CheckConfig::default(),
            },
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let check = |user: &str, password: &str| {
            rt.block_on(p.check_login(None, user, "c", password.into())) == Verdict::Admitted
        };
        assert!(check("bob", "hunter2"));
        assert!(!check("bob", "hunter3"));
        assert!(!check("alice", "hunter2"));
        assert!(!check("", ""));
        assert!(p.needs_login_check());
    }

    #[test]
    fn a_bad_hash_in_the_config_is_named() {
        let mut users = BTreeMap::new();
        users.insert(
            "bob".to_owned(),
            UserConfig {
                password_hash: "plain".into(),
            },
        );
        let err = Policy::new(
            "ke",
            &AuthConfig {
                allow_anonymous: true,
                users,
                checks: CheckConfig::default(),
            },
            &AclConfig::default(),
            10,
        )
        .unwrap_err();
        assert!(err.contains("broker.auth.users.bob.password_hash"), "{err}");
    }
}
