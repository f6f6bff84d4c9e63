/*
 * litegraph-gate: the first exec of every confined guest, in place of a gate shell
 * and setpriv (two dynamically linked execs), and the stage a pooled sandbox waits in.
 *
 *   litegraph-gate gate [-u UID] [-k] -- PROGRAM ARG...
 *     Waits for one line on fd 0 (the daemon writes it once the start is journaled);
 *     end of file before it: exit 126, nothing run. Then fd 0 becomes /dev/null (-k
 *     keeps it: a pooled sandbox's stage reads its command from it next), -u takes
 *     UID and the gid of that number with no supplementary group and no capability
 *     in any set, and PROGRAM (an absolute path: bwrap) is executed.
 *
 *   litegraph-gate stage TOKEN_FILE
 *     Inside a ready sandbox, as the guest's uid: reads one message from fd 0 up to
 *     end of file, NUL-terminated records: "litegraph-stage-1", then "T" + the token
 *     text (written to TOKEN_FILE, 0400), "E" + NAME=VALUE each, "A" + each argument,
 *     and "." last. A message cut short (no "."), malformed or over MAX_MESSAGE runs
 *     nothing: exit 126. Then fd 0 becomes /dev/null and the argv is executed with
 *     exactly that environment and PWD (as bwrap sets it), found on its PATH as bwrap
 *     would, under the keeper (below).
 *
 *   litegraph-gate keep -- PROGRAM ARG...
 *     Inside a sandbox: runs PROGRAM (found on PATH) under the keeper and exits as it
 *     did (128 + the signal's number if one ended it).
 *
 * The keeper: the guest's first process inside its sandbox, so that an ending gives
 * every guest process its grace. bubblewrap ends the whole sandbox as soon as its
 * first process exits; were that the guest's own (`sh -c "a; b"`), a SIGTERM that
 * ends the shell would take `a` and its TERM handler with it at once. The keeper forks
 * the guest and adopts its orphans (a child subreaper). Normally it exits with the
 * guest's first process, and the sandbox's leftovers go with it as before; once it
 * has had the daemon's SIGTERM (sent to it before the guest's processes) it waits for
 * every guest process to exit, which the daemon bounds by its kill grace.
 *
 * Statically linked (scripts/build-gate): no dynamic loading on the start path.
 * Only the daemon runs it, as root or as the daemon's user; it is not setuid.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define NEVER_RAN 126
#define SETUP_FAILED 125
#define EXEC_FAILED 127
#define MAX_MESSAGE (8 << 20)
#define MAX_RECORDS 65536
#define MAGIC "litegraph-stage-1"

extern char **environ;

static void die(int code, const char *what) {
    fprintf(stderr, "litegraph-gate: %s: %s\n", what, strerror(errno));
    _exit(code);
}

/* One byte at a time: what follows the line is not ours to read. */
static void wait_for_line(void) {
    char c;
    for (;;) {
        ssize_t n = read(0, &c, 1);
        if (n == 1 && c == '\n') return;
        if (n == 1) continue;
        if (n < 0 && errno == EINTR) continue;
        _exit(NEVER_RAN);
    }
}

static void stdin_from_null(void) {
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) die(SETUP_FAILED, "open /dev/null");
    if (dup2(fd, 0) < 0) die(SETUP_FAILED, "dup2");
    close(fd);
}

static void become(const char *text) {
    char *end;
    errno = 0;
    unsigned long uid = strtoul(text, &end, 10);
    if (errno != 0 || *end != '\0' || end == text || uid == 0 || uid > 0x7ffffffeUL) {
        fprintf(stderr, "litegraph-gate: bad uid %s\n", text);
        _exit(SETUP_FAILED);
    }
    /* Groups and gid first: once the uid is given up they can no longer change. */
    if (setgroups(0, NULL) != 0) die(SETUP_FAILED, "setgroups");
    if (setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) != 0) die(SETUP_FAILED, "setresgid");
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0) die(SETUP_FAILED, "setresuid");
    /* Leaving root clears the permitted and effective sets; a daemon that is not root
     * may hold ambient and inheritable ones (systemd's AmbientCapabilities=). */
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        die(SETUP_FAILED, "clear ambient capabilities");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) != 0) die(SETUP_FAILED, "capset");
}

static int gate(int argc, char **argv) {
    const char *uid = NULL;
    int keep_stdin = 0;
    int i = 2;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strcmp(argv[i], "-u") == 0 && i + 1 < argc) {
            uid = argv[++i];
        } else if (strcmp(argv[i], "-k") == 0) {
            keep_stdin = 1;
        } else {
            fprintf(stderr, "litegraph-gate: unknown option %s\n", argv[i]);
            return SETUP_FAILED;
        }
    }
    if (i + 1 >= argc || argv[i + 1][0] != '/') {
        fprintf(stderr, "litegraph-gate: gate needs -- and an absolute program path\n");
        return SETUP_FAILED;
    }
    wait_for_line();
    if (!keep_stdin) stdin_from_null();
    if (uid != NULL) become(uid);
    execv(argv[i + 1], argv + i + 1);
    die(EXEC_FAILED, argv[i + 1]);
    return EXEC_FAILED;
}

static char *read_message(size_t *size) {
    size_t cap = 4096, used = 0;
    char *buf = malloc(cap);
    if (buf == NULL) _exit(NEVER_RAN);
    for (;;) {
        if (used == cap) {
            if (cap >= MAX_MESSAGE) _exit(NEVER_RAN);
            cap *= 2;
            buf = realloc(buf, cap);
            if (buf == NULL) _exit(NEVER_RAN);
        }
        ssize_t n = read(0, buf + used, cap - used);
        if (n == 0) break;
        if (n < 0) {
            if (errno == EINTR) continue;
            _exit(NEVER_RAN);
        }
        used += (size_t)n;
    }
    *size = used;
    return buf;
}

static void write_tokens(const char *path, const char *text, size_t length) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0400);
    if (fd < 0) die(NEVER_RAN, path);
    while (length > 0) {
        ssize_t n = write(fd, text, length);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die(NEVER_RAN, path);
        text += n;
        length -= (size_t)n;
    }
    if (close(fd) != 0) die(NEVER_RAN, path);
}

static volatile sig_atomic_t ending = 0;

/* Only the daemon's SIGTERM starts an ending: it comes from outside the sandbox's pid
 * namespace, where its sender has no pid (si_pid 0). The guest's own (`kill 0`, a
 * `trap 'kill 0' EXIT`) reaches the keeper too, as its process group's member, and must
 * not keep the sandbox waiting for what the guest left behind. */
static void on_term(int signum, siginfo_t *info, void *context) {
    (void)signum;
    (void)context;
    if (info->si_pid == 0) ending = 1;
}

static int exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return SETUP_FAILED;
}

/* Runs `args` with `envs` (NULL: this process's environment) as the keeper's child. */
static int keep(char **args, char **envs) {
    sigset_t term, old;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    /* Blocked across the fork: a SIGTERM meant for the guest before it existed is
     * passed on to it below, never lost. One that comes later, from a daemon that
     * listed the sandbox's processes before the fork, is sent to the guest by the
     * daemon itself (it lists them again after signalling the keeper). */
    if (sigprocmask(SIG_BLOCK, &term, &old) != 0) die(NEVER_RAN, "sigprocmask");
    struct sigaction action, inherited;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_term;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGTERM, &action, &inherited) != 0) die(NEVER_RAN, "sigaction");
    /* Children must be waited for, whatever SIGCHLD's disposition was inherited. */
    struct sigaction child;
    memset(&child, 0, sizeof child);
    child.sa_handler = SIG_DFL;
    if (sigaction(SIGCHLD, &child, NULL) != 0) die(NEVER_RAN, "sigaction");
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) die(NEVER_RAN, "subreaper");
    pid_t guest = fork();
    if (guest < 0) die(NEVER_RAN, "fork");
    if (guest == 0) {
        sigaction(SIGTERM, &inherited, NULL); /* as a plain exec would have left it */
        sigprocmask(SIG_SETMASK, &old, NULL);
        if (envs != NULL) environ = envs;
        execvp(args[0], args);
        fprintf(stderr, "litegraph-gate: execvp %s: %s\n", args[0], strerror(errno));
        _exit(EXEC_FAILED);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (ending) kill(guest, SIGTERM);
    int code = -1;
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0 && errno == EINTR) continue;
        if (pid < 0) break; /* ECHILD: every guest process has gone */
        if (pid == guest) {
            code = exit_code(status);
            if (!ending) break;
        }
    }
    return code < 0 ? SETUP_FAILED : code;
}

static int keep_command(int argc, char **argv) {
    if (argc < 4 || strcmp(argv[2], "--") != 0) {
        fprintf(stderr, "litegraph-gate: keep needs -- and a program\n");
        return SETUP_FAILED;
    }
    return keep(argv + 3, NULL);
}

static int stage(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "litegraph-gate: stage needs TOKEN_FILE\n");
        return NEVER_RAN;
    }
    size_t size;
    char *message = read_message(&size);
    if (size == 0 || message[size - 1] != '\0') return NEVER_RAN;
    char **args = calloc(MAX_RECORDS + 1, sizeof *args);
    char **envs = calloc(MAX_RECORDS + 1, sizeof *envs);
    if (args == NULL || envs == NULL) return NEVER_RAN;
    size_t nargs = 0, nenvs = 0, records = 0;
    const char *tokens = NULL;
    size_t tokens_length = 0;
    int complete = 0;
    for (char *record = message; record < message + size; record += strlen(record) + 1) {
        if (complete || ++records > MAX_RECORDS) return NEVER_RAN;
        if (records == 1) {
            if (strcmp(record, MAGIC) != 0) return NEVER_RAN;
        } else if (record[0] == 'A') {
            args[nargs++] = record + 1;
        } else if (record[0] == 'E' && strchr(record + 1, '=') != NULL) {
            envs[nenvs++] = record + 1;
        } else if (record[0] == 'T' && tokens == NULL) {
            tokens = record + 1;
            tokens_length = strlen(tokens);
        } else if (strcmp(record, ".") == 0) {
            complete = 1;
        } else {
            return NEVER_RAN;
        }
    }
    if (!complete || nargs == 0) return NEVER_RAN;
    /* As bwrap does after its --chdir: PWD names the folder the guest starts in. */
    static char pwd[4096 + 4] = "PWD=";
    if (getcwd(pwd + 4, sizeof pwd - 4) == NULL) die(NEVER_RAN, "getcwd");
    size_t kept = 0;
    for (size_t i = 0; i < nenvs; i++)
        if (strncmp(envs[i], "PWD=", 4) != 0) envs[kept++] = envs[i];
    envs[kept++] = pwd;
    envs[kept] = NULL;
    if (tokens != NULL) write_tokens(argv[2], tokens, tokens_length);
    stdin_from_null();
    return keep(args, envs);
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "gate") == 0) return gate(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "stage") == 0) return stage(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "keep") == 0) return keep_command(argc, argv);
    fprintf(stderr,
            "usage: litegraph-gate gate [-u UID] [-k] -- PROGRAM ARG... | stage TOKEN_FILE"
            " | keep -- PROGRAM ARG...\n");
    return SETUP_FAILED;
}
