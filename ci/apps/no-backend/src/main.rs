//! Depends on `sea-orm-inbox` with its default features, which name no backend, as a
//! plain `sea-orm` dependency names no driver. `ci/check-deps.sh` builds it and requires
//! the build to fail with the crate's message naming the features to add.

fn main() {
    let _ = sea_orm_inbox::Inbox::new("never-built");
}
