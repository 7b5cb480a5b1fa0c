/* Docker's /etc/hosts, which init.c gives a run's root and zygote_root.c a warm interpreter's job where
   the image has none (init.c default_hosts says why). */
static const char HOSTS[] = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                            "fe00::0\tip6-localnet\nff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\n"
                            "ff02::2\tip6-allrouters\n127.0.1.1\tsandbox\n";
