# Sourced by build-offline-base.sh, with ROOTFS set: what is mounted in the tree.
#
# debootstrap mounts /proc (and may mount /sys and device nodes) in the tree and
# unmounts them when it exits, but that unmount can fail (busy) and is not
# checked: a /proc left there was then walked by `find`, put into the image's tar
# and made the import fail. Whatever is still mounted below the tree is
# unmounted, deepest first, after debootstrap and before the tree is removed;
# the removal (and the build's tar) never cross into another file system.

# The mount points below $ROOTFS, deepest first.
mounted_below() { awk -v root="$ROOTFS" 'index($2, root "/") == 1 {print $2}' /proc/mounts | sort -r; }

unmount_tree() {
    local m
    for m in $(mounted_below); do
        umount "$m" 2>/dev/null || umount -l "$m"
        echo "tree-mounts: $m was still mounted; unmounted" >&2
    done
}

remove_tree() { unmount_tree; rm -rf --one-file-system "$ROOTFS"; }
