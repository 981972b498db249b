"""`pep517_wheel`: a package's wheel from its own pyproject.toml, built offline by tools/wheel/build_wheel.py."""

def _pep517_wheel_impl(ctx):
    wheel = ctx.actions.declare_file("{}-{}-py3-none-any.whl".format(ctx.attr.distribution, ctx.attr.version))
    package_dir = ctx.label.package
    args = ctx.actions.args()
    args.add("--package-dir", package_dir)
    args.add("--out", wheel)
    args.add_all(ctx.files.srcs)
    ctx.actions.run(
        executable = ctx.executable._builder,
        arguments = [args],
        inputs = ctx.files.srcs,
        outputs = [wheel],
        mnemonic = "Pep517Wheel",
        progress_message = "Building wheel {}".format(wheel.basename),
    )
    return [DefaultInfo(files = depset([wheel]))]

pep517_wheel = rule(
    implementation = _pep517_wheel_impl,
    doc = "Builds the wheel of the package in this BUILD file's folder from its pyproject.toml and `srcs`.",
    attrs = {
        "distribution": attr.string(mandatory = True, doc = "The wheel's distribution name, e.g. chat_core."),
        "version": attr.string(mandatory = True, doc = "The version pyproject.toml declares."),
        "srcs": attr.label_list(allow_files = True, mandatory = True, doc = "pyproject.toml and the package's files."),
        "_builder": attr.label(default = "//tools/wheel:build_wheel", executable = True, cfg = "exec"),
    },
)
