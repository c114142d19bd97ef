// A gRPC client that shares no code with grpcio: grpc-js on Node's HTTP/2 (nghttp2).
// tests/integration/test_grpc_js_interop.py runs it against `kiln serve` and checks what
// it prints: one JSON object per run.
//
//   node client.mjs <host:port> <proto root> <scenario> [args...]
//
// kiln's grpc_service.proto has Triton's messages and field numbers under the protobuf
// package `kiln.inference`; the methods are served under Triton's paths, so each path is
// rewritten to `/inference.GRPCInferenceService/<Method>` here.
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";
import path from "node:path";

const [address, protoRoot, scenario, ...args] = process.argv.slice(2);

function client() {
  const definition = protoLoader.loadSync(
    path.join(protoRoot, "kiln/frontends/grpc/grpc_service.proto"),
    { keepCase: true, longs: String, enums: String, defaults: true, includeDirs: [protoRoot] },
  );
  const service = definition["kiln.inference.GRPCInferenceService"];
  const methods = {};
  for (const [name, method] of Object.entries(service)) {
    methods[name] = { ...method, path: `/inference.GRPCInferenceService/${name}` };
  }
  const Client = grpc.makeGenericClientConstructor(methods, "GRPCInferenceService");
  return new Client(address, grpc.credentials.createInsecure(), {
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
    "grpc.max_send_message_length": 64 * 1024 * 1024,
  });
}

function unary(stub, method, request) {
  return new Promise((resolve) => {
    stub[method](request, (error, response) => {
      resolve(error ? { code: error.code, details: error.details } : { response });
    });
  });
}

function int32s(values) {
  const buffer = Buffer.alloc(values.length * 4);
  values.forEach((v, i) => buffer.writeInt32LE(v, i * 4));
  return buffer;
}

function readInt32s(buffer) {
  const out = [];
  for (let i = 0; i < buffer.length; i += 4) out.push(buffer.readInt32LE(i));
  return out;
}

function readFloat32s(buffer) {
  const out = [];
  for (let i = 0; i < buffer.length; i += 4) out.push(buffer.readFloatLE(i));
  return out;
}

const scenarios = {
  // ServerLive, ServerMetadata and ModelMetadata: repeated fields, strings, int64 shapes
  async metadata(stub) {
    const live = await unary(stub, "ServerLive", {});
    const server = await unary(stub, "ServerMetadata", {});
    const model = await unary(stub, "ModelMetadata", { name: "simple", version: "" });
    return {
      live: live.response.live,
      server: server.response.name,
      extensions: server.response.extensions.length,
      inputs: model.response.inputs.map((t) => [t.name, t.datatype, t.shape.map(Number)]),
    };
  },

  // ModelInfer on `simple` with raw_input_contents: OUTPUT0 = a + b, OUTPUT1 = a - b
  async simple(stub) {
    const a = Array.from({ length: 16 }, (_, i) => i);
    const b = Array.from({ length: 16 }, () => 3);
    const tensor = (name) => ({ name, datatype: "INT32", shape: [1, 16] });
    const { response, code, details } = await unary(stub, "ModelInfer", {
      model_name: "simple",
      id: "js-1",
      inputs: [tensor("INPUT0"), tensor("INPUT1")],
      raw_input_contents: [int32s(a), int32s(b)],
    });
    if (!response) return { code, details };
    const names = response.outputs.map((o) => o.name);
    return {
      id: response.id,
      outputs: Object.fromEntries(
        names.map((n, i) => [n, readInt32s(response.raw_output_contents[i])]),
      ),
    };
  },

  // One FP32 tensor of N elements through an identity model, both ways: several times
  // HTTP/2's initial flow-control window, so both sides must grant more window.
  async large(stub, [model, count]) {
    const n = Number(count);
    const data = Buffer.alloc(n * 4);
    for (let i = 0; i < n; i++) data.writeFloatLE((i % 1000) / 8, i * 4);
    const { response, code, details } = await unary(stub, "ModelInfer", {
      model_name: model,
      inputs: [{ name: "X", datatype: "FP32", shape: [n] }],
      raw_input_contents: [data],
    });
    if (!response) return { code, details };
    const out = response.raw_output_contents[0];
    const values = readFloat32s(out);
    return { bytes: out.length, equal: Buffer.compare(out, data) === 0, last: values[n - 1] };
  },

  // N calls at once on one channel (one HTTP/2 connection, N concurrent streams), each
  // with its own operands and, every 10th, a 256 KiB tensor: every answer is its own.
  async parallel(stub, [count]) {
    const n = Number(count);
    const calls = Array.from({ length: n }, async (_, k) => {
      if (k % 10 === 9) {
        const data = Buffer.alloc(65536 * 4);
        data.fill(k % 251);
        const { response } = await unary(stub, "ModelInfer", {
          model_name: "big",
          inputs: [{ name: "X", datatype: "FP32", shape: [65536] }],
          raw_input_contents: [data],
        });
        return Boolean(response) && Buffer.compare(response.raw_output_contents[0], data) === 0;
      }
      const a = Array.from({ length: 16 }, (_, i) => k * 100 + i);
      const tensor = (name) => ({ name, datatype: "INT32", shape: [1, 16] });
      const { response } = await unary(stub, "ModelInfer", {
        model_name: "simple",
        inputs: [tensor("INPUT0"), tensor("INPUT1")],
        raw_input_contents: [int32s(a), int32s(a)],
      });
      if (!response) return false;
      const sum = readInt32s(response.raw_output_contents[0]);
      return sum.every((v, i) => v === 2 * a[i]);
    });
    const results = await Promise.all(calls);
    return { ok: results.filter(Boolean).length, total: n };
  },

  // ModelStreamInfer on the decoupled `repeat_int32`: each request's values come back as
  // separate responses on the same stream, followed by the empty final response asked for.
  async stream(stub, [firstCount, secondCount]) {
    const call = stub.ModelStreamInfer();
    const got = {};
    const finals = [];
    const done = new Promise((resolve, reject) => {
      call.on("data", (message) => {
        if (message.error_message) {
          got.error = message.error_message;
          return;
        }
        const response = message.infer_response;
        const final = response.parameters.triton_final_response?.bool_param;
        if (final) {
          finals.push(response.id);
          if (finals.length === 2) call.end();
          return;
        }
        const index = response.outputs.findIndex((o) => o.name === "OUT");
        (got[response.id] ??= []).push(readInt32s(response.raw_output_contents[index])[0]);
      });
      call.on("end", resolve);
      call.on("error", reject);
    });
    for (const [id, count] of [["first", Number(firstCount)], ["second", Number(secondCount)]]) {
      const values = Array.from({ length: count }, (_, i) => 100 * (id === "first" ? 1 : 2) + i);
      call.write({
        model_name: "repeat_int32",
        id,
        inputs: [{ name: "IN", datatype: "INT32", shape: [count] }],
        raw_input_contents: [int32s(values)],
        parameters: { triton_enable_empty_final_response: { bool_param: true } },
      });
    }
    await done;
    return { responses: got, finals };
  },

  // Errors come back as gRPC statuses with Triton's words, and the channel stays usable.
  async errors(stub) {
    const unknown = await unary(stub, "ModelInfer", {
      model_name: "no_such_model",
      inputs: [],
      raw_input_contents: [],
    });
    const wrongShape = await unary(stub, "ModelInfer", {
      model_name: "simple",
      inputs: [{ name: "INPUT0", datatype: "INT32", shape: [1, 3] }],
      raw_input_contents: [int32s([1, 2, 3])],
    });
    const after = await scenarios.simple(stub);
    return { unknown, wrongShape, afterOk: Boolean(after.outputs) };
  },

  // A stream the client cancels while the model (`ticker`: a response every 10 ms) is
  // still sending: the model sees it, and the server goes on serving this channel.
  async cancel(stub) {
    const call = stub.ModelStreamInfer();
    let received = 0;
    const some = new Promise((resolve) =>
      call.on("data", () => {
        received += 1;
        if (received === 3) resolve();
      }),
    );
    call.on("error", () => {}); // CANCELLED, which this client asked for
    call.write({
      model_name: "ticker",
      inputs: [{ name: "COUNT", datatype: "INT32", shape: [1] }],
      raw_input_contents: [int32s([1000])],
    });
    await some;
    call.cancel();
    const after = await scenarios.simple(stub);
    return { received, afterOk: Boolean(after.outputs) };
  },
};

const stub = client();
try {
  const result = await scenarios[scenario](stub, args);
  process.stdout.write(JSON.stringify(result) + "\n");
} finally {
  stub.close();
}
