/*
 * squashfuse_cached: squashfuse_ll for read-only images that never change, with the
 * kernel's FUSE caches turned on.
 *
 *     squashfuse_cached [-f] [-d] [-o offset=N[,fuse options]] IMAGE MOUNTPOINT
 *
 * The same command line and file system as Debian's squashfuse_ll, built on its
 * libsquashfuse_ll. squashfuse_ll answers every open(), opendir()+readdir() and
 * readlink() with a FUSE round trip through one single-threaded daemon: about 70 round
 * trips for one `python3 -c pass`, a third of a short run's cost under load. An image
 * in the store is immutable, so the kernel may cache all of it:
 *   - open and opendir answer ENOSYS: the kernel then stops sending them (and their
 *     releases) and opens every file with FOPEN_KEEP_CACHE, every directory with
 *     FOPEN_CACHE_DIR, so readdir is served from the page cache too (Linux 5.1+);
 *   - FUSE_CAP_CACHE_SYMLINKS keeps symlink targets in the page cache (Linux 4.20+);
 *   - an image without extended attributes (a flattened environment) answers ENOSYS
 *     to getxattr and listxattr: the kernel stops asking and says EOPNOTSUPP itself.
 *     A fresh overlay asks for its user.overlay.* attributes on every lower directory
 *     it walks: 50 round trips for one `python3` run that writes a file.
 * On a kernel without these, the file system falls back to squashfuse_ll's own open
 * and opendir, whose file handles the read and readdir below also accept.
 */
#define _GNU_SOURCE
#include <squashfuse/ll.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int no_open, no_opendir;  /* the kernel can go without open/opendir */
static int no_xattrs;             /* the image has none */

static void op_init(void *userdata, struct fuse_conn_info *conn) {
	(void)userdata;
	if (conn->capable & FUSE_CAP_CACHE_SYMLINKS)
		conn->want |= FUSE_CAP_CACHE_SYMLINKS;
	no_open = !!(conn->capable & FUSE_CAP_NO_OPEN_SUPPORT);
	no_opendir = !!(conn->capable & FUSE_CAP_NO_OPENDIR_SUPPORT);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
	if (no_open)  /* the mount is read-only: the kernel refuses writes before asking */
		fuse_reply_err(req, ENOSYS);
	else
		sqfs_ll_op_open(req, ino, fi);  /* fh: a malloc'd sqfs_inode, freed in release */
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
	if (no_opendir)
		fuse_reply_err(req, ENOSYS);
	else
		sqfs_ll_op_opendir(req, ino, fi);  /* fh: a malloc'd sqfs_ll_i */
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size) {
	if (no_xattrs)
		fuse_reply_err(req, ENOSYS);
	else
		sqfs_ll_op_getxattr(req, ino, name, size);
}

static void op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
	if (no_xattrs)
		fuse_reply_err(req, ENOSYS);
	else
		sqfs_ll_op_listxattr(req, ino, size);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
	sqfs_ll_i lli;
	sqfs_inode *inode = (sqfs_inode *)(intptr_t)fi->fh;
	if (!inode) {  /* opened without an open request: look the inode up */
		if (sqfs_ll_iget(req, &lli, ino))
			return;  /* replied already */
		inode = &lli.inode;
	}
	char *buf = malloc(size);
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	off_t got = size;
	if (sqfs_read_range(&((sqfs_ll *)fuse_req_userdata(req))->fs, inode, off, &got, buf))
		fuse_reply_err(req, EIO);
	else
		fuse_reply_buf(req, buf, got);
	free(buf);
}

/* Entries from directory offset `off`: "." and ".." are offsets 0 and 1, the image's
 * entries follow at their squashfs offsets + 2. */
static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
	sqfs_ll_i own, *lli = (sqfs_ll_i *)(intptr_t)fi->fh;
	if (!lli) {
		if (sqfs_ll_iget(req, &own, ino))
			return;
		lli = &own;
	}
	if (!S_ISDIR(lli->inode.base.mode)) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	char *buf = malloc(size), *pos = buf;
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	struct stat st = {.st_ino = 1, .st_mode = S_IFDIR};
	size_t left = size, esize;
	for (; off < 2; off++) {
		esize = fuse_add_direntry(req, pos, left, off ? ".." : ".", &st, off + 1);
		if (esize > left)
			goto reply;
		pos += esize;
		left -= esize;
	}
	sqfs_dir dir;
	sqfs_name name;
	sqfs_dir_entry entry;
	sqfs_err err = SQFS_OK;
	if (sqfs_dir_open(&lli->ll->fs, &lli->inode, &dir, off - 2)) {
		fuse_reply_err(req, EINVAL);
		free(buf);
		return;
	}
	sqfs_dentry_init(&entry, name);
	while (sqfs_dir_next(&lli->ll->fs, &dir, &entry, &err)) {
		st.st_ino = lli->ll->ino_fuse_num(lli->ll, &entry);
		st.st_mode = sqfs_dentry_mode(&entry);
		esize = fuse_add_direntry(req, pos, left, sqfs_dentry_name(&entry), &st,
		                          sqfs_dentry_next_offset(&entry) + 2);
		if (esize > left)
			break;
		pos += esize;
		left -= esize;
	}
	if (err) {
		fuse_reply_err(req, EIO);
		free(buf);
		return;
	}
reply:
	fuse_reply_buf(req, buf, pos - buf);
	free(buf);
}

static const struct fuse_lowlevel_ops ops = {
	.init = op_init,
	.lookup = sqfs_ll_op_lookup,
	.forget = sqfs_ll_op_forget,
	.getattr = sqfs_ll_op_getattr,
	.readlink = sqfs_ll_op_readlink,
	.open = op_open,
	.read = op_read,
	.release = sqfs_ll_op_release,
	.opendir = op_opendir,
	.readdir = op_readdir,
	.releasedir = sqfs_ll_op_releasedir,
	.statfs = stfs_ll_op_statfs,
	.listxattr = op_listxattr,
	.getxattr = op_getxattr,
	.create = sqfs_ll_op_create,
};

struct options {
	size_t offset;
	int foreground;
	const char *image, *mountpoint;
};

static const struct fuse_opt option_spec[] = {
	{"offset=%zu", offsetof(struct options, offset), 0},
	{"-f", offsetof(struct options, foreground), 1},
	FUSE_OPT_END,
};

static int positional(void *data, const char *arg, int key, struct fuse_args *args) {
	struct options *o = data;
	(void)args;
	if (key != FUSE_OPT_KEY_NONOPT)
		return 1;  /* keep: -d, -o ro, ... go on to FUSE */
	if (!o->image)
		o->image = arg;
	else if (!o->mountpoint)
		o->mountpoint = arg;
	else
		return -1;
	return 0;
}

int main(int argc, char *argv[]) {
	struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
	struct options o = {0};
	if (fuse_opt_parse(&args, &o, option_spec, positional) == -1 || !o.image || !o.mountpoint) {
		fprintf(stderr, "usage: %s [-f] [-d] [-o offset=N[,fuse options]] IMAGE MOUNTPOINT\n", argv[0]);
		return 2;
	}
	fuse_opt_add_arg(&args, "-oro,subtype=squashfuse_cached");  /* the kernel refuses writes itself */
	sqfs_ll *ll = sqfs_ll_open(o.image, o.offset);
	if (!ll)
		return 1;  /* sqfs_ll_open said why */
	no_xattrs = ll->fs.xattr_info.xattr_ids == 0;
	int status = 1;
	sqfs_ll_chan ch;
	if (sqfs_ll_mount(&ch, o.mountpoint, &args, (struct fuse_lowlevel_ops *)&ops, sizeof(ops), ll) == SQFS_OK) {
		/* The parent returns once the mount is up; the daemon serves it until unmounted. */
		if (sqfs_ll_daemonize(o.foreground) != -1 && fuse_set_signal_handlers(ch.session) != -1) {
			status = fuse_session_loop(ch.session) ? 1 : 0;
			fuse_remove_signal_handlers(ch.session);
		}
		sqfs_ll_unmount(&ch, o.mountpoint);
	}
	sqfs_ll_destroy(ll);
	free(ll);
	fuse_opt_free_args(&args);
	return status;
}
